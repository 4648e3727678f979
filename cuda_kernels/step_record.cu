// step_record: one whole step record (header, accept_num, CSR token_ids and, when
// width > 0, lp_ids, lp_vals, ranks), written in the wire layout into `out`.
//
// Semantics (byte-identical to spectrio.cuda_kernels.record_layout.step_record_ref;
// the layout is documented in spectrio/core/record.py):
//
//   accept_num[i] = -9                        if preempted[i]
//                 = 0                         else if seq_lens_decoder[i] < prompt_lens[i]
//                 = accept_counts[i]          otherwise (clamped to [0, cols])
//   token t of the record belongs to slot s = the slot whose CSR range holds t, at
//   position j = t - off[s] (off = exclusive prefix sum of max(accept_num, 0));
//   row(t) = lp_rows_compact ? t : s * tok_stride + j
//   token_ids[t]    = accepted_tokens[s * tok_stride + j]
//   lp_ids[t, c]    = c <= topn[s] ? topk_ids[row(t) * w_max + c]  : -1
//   lp_vals[t, c]   = c <= topn[s] ? topk_vals[row(t) * w_max + c] : 0.0f  (bits copied)
//   ranks[t]        = topn[s] >= 0 ? ranks[row(t)] : -1
//   words [record end, fill_to) of `out` are set to 0 (so a fixed-size copy of the
//   first fill_to words reads only written memory).
//
// The per-step scalars live in `params`, device memory the host's copy fills just before
// the launch, so one captured launch serves every step of a captured batch size:
//   params[0] bsz (<= STEP_RECORD_MAX_BSZ), [1] cols = k + 1 this step (<= tok_stride),
//   params[2] kind | (width << 8) (width <= w_max), [3] fill_to (words, 0: none).
//
// Launch: any 1-D grid of STEP_RECORD_THREADS-thread blocks. Every block scans the
// (<= 1024) slots itself in shared memory, so no block waits for another; the grid
// then shares the record's words, consecutive threads writing consecutive words.

#define STEP_RECORD_MAX_BSZ 1024
#define STEP_RECORD_THREADS 256
#define PREEMPTED_ACCEPT_NUM (-9)

extern "C" __global__ void __launch_bounds__(STEP_RECORD_THREADS) step_record(
    const int* __restrict__ params,               // [4], see above
    const int* __restrict__ accepted_tokens,      // [>= bsz, tok_stride]
    const int tok_stride,
    const int* __restrict__ accept_counts,        // [>= bsz]
    const unsigned char* __restrict__ preempted,  // [>= bsz], nonzero = preempted/aborted
    const int* __restrict__ seq_lens_decoder,     // [>= bsz]
    const int* __restrict__ prompt_lens,          // [>= bsz]
    const int* __restrict__ topn,                 // [>= bsz], top-N per slot, -1 none
    const int* __restrict__ topk_ids,             // [rows, w_max]
    const int* __restrict__ topk_val_bits,        // [rows, w_max] float32 read as bits
    const int* __restrict__ ranks,                // [rows]
    const int w_max,
    const int lp_rows_compact,
    const int version,
    int* __restrict__ out)
{
    __shared__ int s_acc[STEP_RECORD_MAX_BSZ];
    __shared__ int s_off[STEP_RECORD_MAX_BSZ];
    __shared__ int s_warp[STEP_RECORD_THREADS / 32];

    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int bsz = params[0];
    const int cols = params[1];
    const int packed = params[2];
    const int fill_to = params[3];
    const int width = packed >> 8;

    // accept_num per slot, slot after slot across the block (coalesced). Every load of a
    // thread's (at most four) slots is issued before any is used, so they wait together.
    constexpr int SLOTS_PER_THREAD = STEP_RECORD_MAX_BSZ / STEP_RECORD_THREADS;
    unsigned char pre[SLOTS_PER_THREAD];
    int dec[SLOTS_PER_THREAD], plen[SLOTS_PER_THREAD], cnt[SLOTS_PER_THREAD];
#pragma unroll
    for (int r = 0; r < SLOTS_PER_THREAD; ++r) {
        const int i = tid + r * STEP_RECORD_THREADS;
        if (i < bsz) {
            pre[r] = preempted[i];
            dec[r] = seq_lens_decoder[i];
            plen[r] = prompt_lens[i];
            cnt[r] = accept_counts[i];
        }
    }
#pragma unroll
    for (int r = 0; r < SLOTS_PER_THREAD; ++r) {
        const int i = tid + r * STEP_RECORD_THREADS;
        if (i < bsz) {
            const int c = cnt[r] < 0 ? 0 : (cnt[r] > cols ? cols : cnt[r]);
            s_acc[i] = pre[r] ? PREEMPTED_ACCEPT_NUM : (dec[r] < plen[r] ? 0 : c);
        }
    }
    __syncthreads();

    // Exclusive prefix sum of max(accept_num, 0): each thread owns a contiguous run of
    // slots; the runs' sums are scanned within each warp by shuffles, then across warps.
    const int per = (bsz + STEP_RECORD_THREADS - 1) / STEP_RECORD_THREADS;
    const int first = min(tid * per, bsz);
    const int last = min(first + per, bsz);
    int local = 0;
    for (int i = first; i < last; ++i) {
        local += max(s_acc[i], 0);
    }
    int incl = local;
    for (int o = 1; o < 32; o <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += up;
    }
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    if (warp == 0) {
        int w = lane < STEP_RECORD_THREADS / 32 ? s_warp[lane] : 0;
        for (int o = 1; o < 32; o <<= 1) {
            const int up = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o) w += up;
        }
        if (lane < STEP_RECORD_THREADS / 32) s_warp[lane] = w;
    }
    __syncthreads();
    int run = incl - local + (warp > 0 ? s_warp[warp - 1] : 0);
    for (int i = first; i < last; ++i) {
        s_off[i] = run;
        run += max(s_acc[i], 0);
    }
    __syncthreads();

    const int n = s_warp[STEP_RECORD_THREADS / 32 - 1];
    const long long tok_at = 4 + (long long)bsz;
    const long long lp_ids_at = tok_at + n;
    const long long block = (long long)n * width;
    const long long lp_vals_at = lp_ids_at + block;
    const long long ranks_at = lp_vals_at + block;
    const long long end = width > 0 ? ranks_at + n : tok_at + n;

    const long long gtid = (long long)blockIdx.x * blockDim.x + tid;
    const long long gstride = (long long)gridDim.x * blockDim.x;

    for (long long w = gtid; w < tok_at; w += gstride) {
        int v;
        if (w == 0) v = version;
        else if (w == 1) v = packed;
        else if (w == 2) v = bsz;
        else if (w == 3) v = n;
        else v = s_acc[w - 4];
        out[w] = v;
    }

    // The slot owning token t: the largest s with off[s] <= t (always an emitting slot).
    for (long long t = gtid; t < n; t += gstride) {
        int lo = 0, hi = bsz - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_off[mid] <= t) lo = mid; else hi = mid - 1;
        }
        const int j = (int)(t - s_off[lo]);
        const long long src = (long long)lo * tok_stride + j;
        out[tok_at + t] = accepted_tokens[src];
        if (width > 0) {
            const long long row = lp_rows_compact ? t : src;
            out[ranks_at + t] = topn[lo] >= 0 ? ranks[row] : -1;
        }
    }

    for (long long w = gtid; w < block; w += gstride) {
        const long long t = w / width;
        const int c = (int)(w - t * width);
        int lo = 0, hi = bsz - 1;
        while (lo < hi) {
            const int mid = (lo + hi + 1) >> 1;
            if (s_off[mid] <= t) lo = mid; else hi = mid - 1;
        }
        const long long row =
            lp_rows_compact ? t : (long long)lo * tok_stride + (t - s_off[lo]);
        const bool want = c <= topn[lo];
        const long long src = row * w_max + c;
        out[lp_ids_at + w] = want ? topk_ids[src] : -1;
        out[lp_vals_at + w] = want ? topk_val_bits[src] : 0;
    }

    for (long long w = end + gtid; w < fill_to; w += gstride) {
        out[w] = 0;
    }
}
