// speculate_save: header, accept_num and CSR token_ids of one step record.
//
// Semantics (byte-identical to spectrio.cuda_kernels.reference.speculate_save_ref
// on valid input; the record layout is documented in spectrio/wire/record.py):
//
//   accept_num[i] = -9                        if preempted[i]
//                 = 0                         else if seq_lens_decoder[i] < prompt_lens[i]
//                 = accept_counts[i]          otherwise (clamped to [0, cols])
//   out[0..3]     = {version, packed, bsz, num_tokens}, packed = kind | (width << 8)
//   out[4 + i]    = accept_num[i]
//   out[4 + bsz + off[i] + j] = accepted_tokens[i * cols + j],  j < max(accept_num[i], 0)
//
// where off is the exclusive prefix sum of max(accept_num, 0).
//
// Launch: ONE block of blockDim.x >= bsz threads, blockDim.x <= SPECULATE_SAVE_MAX_BSZ
// (a single-block Hillis-Steele scan in shared memory). The loader rejects
// bsz > SPECULATE_SAVE_MAX_BSZ. `out` must hold 4 + bsz + bsz * cols int32;
// only its first 4 + bsz + num_tokens words are written.

#define SPECULATE_SAVE_MAX_BSZ 1024
#define PREEMPTED_ACCEPT_NUM (-9)

extern "C" __global__ void speculate_save(
    const int* __restrict__ accepted_tokens,      // [bsz, cols]
    const int* __restrict__ accept_counts,        // [bsz]
    const unsigned char* __restrict__ preempted,  // [bsz], nonzero = preempted/aborted
    const int* __restrict__ seq_lens_decoder,     // [bsz]
    const int* __restrict__ prompt_lens,          // [bsz]
    const int bsz,
    const int cols,                               // k + 1
    const int version,
    const int packed,                             // (kind & 0xFF) | (width << 8)
    int* __restrict__ out)                        // [4 + bsz + bsz * cols]
{
    __shared__ int scan[SPECULATE_SAVE_MAX_BSZ];
    const int tid = threadIdx.x;
    const int nthreads = blockDim.x;

    int accept = 0;
    if (tid < bsz) {
        if (preempted[tid]) {
            accept = PREEMPTED_ACCEPT_NUM;
        } else if (seq_lens_decoder[tid] < prompt_lens[tid]) {
            accept = 0;
        } else {
            const int c = accept_counts[tid];
            accept = c < 0 ? 0 : (c > cols ? cols : c);
        }
    }
    const int emitted = accept > 0 ? accept : 0;

    // Inclusive scan of `emitted` over the block.
    scan[tid] = emitted;
    __syncthreads();
    for (int stride = 1; stride < nthreads; stride <<= 1) {
        const int add = tid >= stride ? scan[tid - stride] : 0;
        __syncthreads();
        scan[tid] += add;
        __syncthreads();
    }
    const int total = scan[nthreads - 1];
    const int offset = scan[tid] - emitted;  // exclusive

    if (tid == 0) {
        out[0] = version;
        out[1] = packed;
        out[2] = bsz;
        out[3] = total;
    }
    if (tid < bsz) {
        out[4 + tid] = accept;
        const int* src = accepted_tokens + (long long)tid * cols;
        int* dst = out + 4 + bsz + offset;
        for (int j = 0; j < emitted; ++j) {
            dst[j] = src[j];
        }
    }
}
