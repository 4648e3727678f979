// pack_topk: the logprob block of one step record, exactly `width` columns wide.
//
// Semantics (byte-identical to spectrio.cuda_kernels.reference.pack_topk_ref;
// the record layout is documented in spectrio/wire/record.py):
//
//   for token t < num_tokens, column c < width:
//     lp_ids[t, c]  = c <= topn[t] ? topk_ids[t, c]  : -1
//     lp_vals[t, c] = c <= topn[t] ? topk_vals[t, c] : 0.0f
//   ranks_out[t] = topn[t] >= 0 ? ranks_in[t] : -1
//
// topk_ids / topk_vals are row-major [num_tokens, w_max] with w_max >= width;
// column 0 is the emitted token. topn[t] is the top-N that token's request
// asked for (-1: no logprobs). Launch: any 1-D grid (grid-stride loop).

extern "C" __global__ void pack_topk(
    const int* __restrict__ topk_ids,     // [num_tokens, w_max]
    const float* __restrict__ topk_vals,  // [num_tokens, w_max]
    const int* __restrict__ ranks_in,     // [num_tokens]
    const int* __restrict__ topn,         // [num_tokens]
    const int num_tokens,
    const int w_max,
    const int width,
    int* __restrict__ lp_ids,             // [num_tokens, width]
    float* __restrict__ lp_vals,          // [num_tokens, width]
    int* __restrict__ ranks_out)          // [num_tokens]
{
    const long long total = (long long)num_tokens * width;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long idx = (long long)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
         idx += step) {
        const long long t = idx / width;
        const int c = (int)(idx - t * width);
        const int n = topn[t];
        const long long src = t * w_max + c;
        const bool want = c <= n;
        lp_ids[idx] = want ? topk_ids[src] : -1;
        lp_vals[idx] = want ? topk_vals[src] : 0.0f;
        if (c == 0) {
            ranks_out[t] = n >= 0 ? ranks_in[t] : -1;
        }
    }
}
