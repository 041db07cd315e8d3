// Runs the masked_attention kernels of src/cuda/attention.cu on the CPU (scripts/emulate/common.cuh
// stands in for the GPU) and checks the output, log-sum-exp and the three gradients against an
// f64 reference, for every mask kind, dtype and padded head dim. Build and run: scripts/emulate/run.sh.
#include <cstdio>
#include <functional>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <ucontext.h>
#include <vector>

#include "attention_kernels.inc"  // src/cuda/attention.cu with its shared-memory declaration rewritten

namespace C = fastops_constants::attention;

// Runs `call` for every block of `grid` with `threads` threads, one block at a time, shared
// memory poisoned (0xFF) before each block. The threads are contexts on this OS thread, run
// round-robin until each has finished the block.
static const std::function<void()>* current_call = nullptr;
static std::vector<char> finished;

static void thread_entry() {
    (*current_call)();
    finished[threadIdx.x] = 1;
}

static void launch(Dim3 grid, int threads, size_t smem_bytes, const std::function<void()>& call) {
    gridDim = grid;
    blockDim = Dim3{static_cast<uint32_t>(threads), 1, 1};
    std::vector<unsigned char> smem(smem_bytes + 16);
    emu::smem = smem.data();
    std::unique_ptr<emu::Warp[]> warps(new emu::Warp[threads / 32]);
    emu::warps = warps.get();
    emu::Barrier block{threads};
    emu::block_barrier = &block;
    current_call = &call;
    constexpr size_t STACK = 1 << 18;
    std::vector<std::vector<char>> stacks(threads, std::vector<char>(STACK));
    emu::contexts.assign(threads, ucontext_t{});
    for (uint32_t y = 0; y < grid.y; ++y)
        for (uint32_t x = 0; x < grid.x; ++x) {
            blockIdx = Dim3{x, y, 0};
            std::memset(smem.data(), 0xff, smem.size());
            finished.assign(threads, 0);
            for (int t = 0; t < threads; ++t) {
                getcontext(&emu::contexts[t]);
                emu::contexts[t].uc_stack.ss_sp = stacks[t].data();
                emu::contexts[t].uc_stack.ss_size = STACK;
                emu::contexts[t].uc_link = &emu::scheduler;
                makecontext(&emu::contexts[t], thread_entry, 0);
            }
            for (bool running = true; running;) {
                running = false;
                for (int t = 0; t < threads; ++t) {
                    if (finished[t]) continue;
                    running = true;
                    threadIdx = Dim3{static_cast<uint32_t>(t), 0, 0};
                    swapcontext(&emu::scheduler, &emu::contexts[t]);
                }
            }
        }
}

enum Kind { FULL, CAUSAL, WINDOW, DOCS, DENSE };

struct Case {
    std::string name;
    int64_t b, h, hk, m, n, d, dv;
    Kind kind;
    int64_t window = 0;
    bool doc_causal = false;
};

template <typename T> struct Host {
    static T from(double x) { return fastops::from_float<T>(static_cast<float>(x)); }
    static double to(T x) { return fastops::to_float<T>(x); }
};

template <typename T> static const char* dtype_name() {
    if constexpr (std::is_same_v<T, float>) return "f32";
    else if constexpr (std::is_same_v<T, __half>) return "f16";
    else return "bf16";
}

// A head-major [B, H, R, C] buffer as token-major [B, R, H, C] (to_tokens), or the other way.
template <typename X>
static std::vector<X> move_heads(const std::vector<X>& x, int64_t B, int64_t H, int64_t R, int64_t C, bool to_tokens) {
    std::vector<X> y(x.size());
    for (int64_t b = 0; b < B; ++b)
        for (int64_t h = 0; h < H; ++h)
            for (int64_t r = 0; r < R; ++r)
                for (int64_t c = 0; c < C; ++c) {
                    const int64_t heads = ((b * H + h) * R + r) * C + c, tokens = ((b * R + r) * H + h) * C + c;
                    if (to_tokens) y[tokens] = x[heads];
                    else y[heads] = x[tokens];
                }
    return y;
}

// Whether out, its gradient and dq, dk, dv lie token-major ([b, rows, heads, cols], as
// masked_attention_packed has them) instead of head-major: the kernels' o / dq / dk / dv strides.
static bool g_token_major = false;

// runs: a document mask passed as MASK_RUNS (each position's document as first | last << 32) to
// the tensor-core kernels' runs instances, as the host does for documents in contiguous runs.
// one_pass: the one-pass backward (D = 128): delta, then attention_bwd_{family}_d128_* (dq through its f32
// buffer), then attention_dq_rows_d128_*.
template <typename T> static int run_case(const Case& c, uint64_t seed, bool runs = false, bool one_pass = false) {
    std::mt19937_64 rng(seed);
    std::uniform_real_distribution<double> uni(-1.0, 1.0);
    const int64_t pd = (c.d + 7) / 8 * 8, pdv = (c.dv + 7) / 8 * 8;  // the host pads to 8
    auto fill = [&](int64_t rows, int64_t cols, int64_t pcols) {
        std::vector<T> v(rows * pcols, Host<T>::from(0.0));
        for (int64_t r = 0; r < rows; ++r)
            for (int64_t x = 0; x < cols; ++x) v[r * pcols + x] = Host<T>::from(uni(rng));
        return v;
    };
    auto q = fill(c.b * c.h * c.m, c.d, pd), k = fill(c.b * c.hk * c.n, c.d, pd);
    auto v = fill(c.b * c.hk * c.n, c.dv, pdv), go = fill(c.b * c.h * c.m, c.dv, pdv);
    const double scale = 1.3 / std::sqrt(static_cast<double>(c.d));
    // Masks.
    std::vector<int64_t> ids(c.b * c.m);
    for (int64_t bi = 0; bi < c.b; ++bi) {
        int64_t id = 0, left = 0;
        for (int64_t i = 0; i < c.m; ++i) {
            if (left == 0) { ++id; left = 1 + rng() % 50; }
            ids[bi * c.m + i] = id;
            --left;
        }
    }
    std::vector<uint8_t> dense(c.m * c.n);
    for (auto& x : dense) x = (rng() % 10 < 4) ? 3 : 0;
    for (int64_t j = 0; j < c.n; ++j) dense[2 * c.n + j] = 0;  // query 2 sees nothing
    auto visible = [&](int64_t bi, int64_t i, int64_t j) {
        const int64_t pos = i + c.n - c.m;
        switch (c.kind) {
        case FULL: return true;
        case CAUSAL: return j <= pos;
        case WINDOW: return j <= pos && pos - j < c.window;
        case DOCS: return ids[bi * c.m + i] == ids[bi * c.m + j] && (!c.doc_causal || j <= i);
        default: return dense[i * c.n + j] != 0;
        }
    };
    const int64_t rt = (c.m + 63) / 64, ct = (c.n + 63) / 64;
    std::vector<uint8_t> states;
    MaskArgs ma{};
    ma.kind = c.kind == FULL ? C::MASK_FULL : c.kind == CAUSAL ? C::MASK_CAUSAL : c.kind == WINDOW ? C::MASK_WINDOW
              : c.kind == DOCS ? C::MASK_DOCUMENTS : C::MASK_DENSE;
    ma.window = std::min(c.window, c.m + c.n + 1);
    ma.doc_causal = c.doc_causal;
    if (c.kind == DOCS || c.kind == DENSE) {
        const int64_t sb = c.kind == DOCS ? c.b : 1;
        for (int64_t bi = 0; bi < sb; ++bi)
            for (int64_t qt = 0; qt < rt; ++qt)
                for (int64_t kt = 0; kt < ct; ++kt) {
                    bool any = false, all = true;
                    for (int64_t i = qt * 64; i < std::min(qt * 64 + 64, c.m); ++i)
                        for (int64_t j = kt * 64; j < std::min(kt * 64 + 64, c.n); ++j) {
                            const bool vis = visible(bi, i, j);
                            any |= vis;
                            all &= vis;
                        }
                    states.push_back(any ? (all ? 2 : 1) : 0);
                }
        ma.states_batch_stride = c.kind == DOCS ? rt * ct : 0;
        ma.states_head_stride = 0;
        ma.dense_strides[0] = ma.dense_strides[1] = 0;
        ma.dense_strides[2] = c.n;
        ma.dense_strides[3] = 1;
    }
    AttentionArgs a{};
    const int64_t qs[3] = {c.h * c.m * pd, c.m * pd, pd}, ks[3] = {c.hk * c.n * pd, c.n * pd, pd},
                  vs[3] = {c.hk * c.n * pdv, c.n * pdv, pdv};
    for (int i = 0; i < 3; ++i) { a.q_strides[i] = qs[i]; a.k_strides[i] = ks[i]; a.v_strides[i] = vs[i]; }
    auto set_strides = [&](int64_t (&to)[3], int64_t heads, int64_t rows, int64_t cols) {
        const int64_t head_major[3] = {heads * rows * cols, rows * cols, cols}, token_major[3] = {rows * heads * cols, cols, heads * cols};
        for (int i = 0; i < 3; ++i) to[i] = g_token_major ? token_major[i] : head_major[i];
    };
    set_strides(a.o_strides, c.h, c.m, pdv);
    set_strides(a.dq_strides, c.h, c.m, pd);
    set_strides(a.dk_strides, c.hk, c.n, pd);
    set_strides(a.dv_strides, c.hk, c.n, pdv);
    // The kernels read the output's gradient as they write the output.
    const auto go_head_major = go;
    if (g_token_major) go = move_heads(go, c.b, c.h, c.m, pdv, true);
    a.batch = c.b; a.heads = c.h; a.kv_heads = c.hk; a.m = c.m; a.n = c.n; a.d = pd; a.dv = pdv;
    a.row_tiles = rt; a.col_tiles = ct;
    a.scale = static_cast<float>(scale);
    a.scale_log2 = static_cast<float>(scale * 1.4426950408889634);
    a.mask = ma;
    a.bwd_pair_group = 3;  // the one-pass backward's block order in groups of 3 pairs (a partial last group)
    const uint8_t* st = states.empty() ? nullptr : states.data();
    const uint8_t* de = c.kind == DENSE ? dense.data() : nullptr;
    const int64_t* id = c.kind == DOCS ? ids.data() : nullptr;
    std::vector<int64_t> doc_runs(c.b * c.m);
    if (runs) {
        for (int64_t bi = 0; bi < c.b; ++bi)
            for (int64_t i = 0; i < c.m; ++i) {
                int64_t first = i, last = i;
                while (first > 0 && ids[bi * c.m + first - 1] == ids[bi * c.m + i]) --first;
                while (last + 1 < c.m && ids[bi * c.m + last + 1] == ids[bi * c.m + i]) ++last;
                doc_runs[bi * c.m + i] = first | (last << 32);
            }
        a.mask.kind = C::MASK_RUNS;
        a.mask.states_batch_stride = 0;
        st = nullptr;
        id = doc_runs.data();
    }

    // The kernels, as the host picks them.
    const bool rows = std::is_same_v<T, float>;
    // The instance family the host picks by the mask's kind (mask_family of src/attention/cuda.rs).
    const int family = a.mask.kind <= C::MASK_WINDOW ? 0 : (a.mask.kind == C::MASK_RUNS ? 1 : 2);
    const int64_t dmax = std::max(pd, pdv), D = dmax <= 64 ? 64 : dmax <= 128 ? 128 : 256;
    // Tiles per block, stages and shared memory as the host's launch code picks them.
    const size_t tile = 64 * (D + C::ROW_PAD) * sizeof(T), qtiles = D > 128 ? 1 : 2;
    const size_t fwd_stages = D > 128 ? 1 : 2, dq_stages = D >= 128 ? 1 : 2, dkdv_stages = D > 128 ? 1 : 2;
    const int64_t query_blocks = c.b * c.h * ((rt + qtiles - 1) / qtiles);
    std::vector<T> out(c.b * c.h * c.m * pdv, Host<T>::from(NAN)), dq(q.size(), Host<T>::from(NAN)),
        dk(k.size(), Host<T>::from(NAN)), dvv(v.size(), Host<T>::from(NAN));
    std::vector<float> lse(c.b * c.h * c.m, NAN), delta(c.b * c.h * c.m, NAN);
    auto blocks = [](int64_t x) { return Dim3{static_cast<uint32_t>(x), 1, 1}; };
    if (rows) {
        const int w = C::ROW_WARPS;
        auto* qf = reinterpret_cast<const float*>(q.data());
        auto* kf = reinterpret_cast<const float*>(k.data());
        auto* vf = reinterpret_cast<const float*>(v.data());
        launch(blocks((c.b * c.h * c.m + w - 1) / w), w * 32, 0,
               [&] { attention_fwd_rows_f32(qf, kf, vf, reinterpret_cast<float*>(out.data()), lse.data(), st, de, id, a); });
    } else {
#define PICK(STEM, DD, S)                                                                                    \
    (family == 0 ? STEM##_generated_d##DD##_##S : family == 1 ? STEM##_runs_d##DD##_##S : STEM##_stored_d##DD##_##S)
#define FWD(DD, S)                                                                                              \
    launch(blocks(query_blocks), 128, (qtiles + 2 * fwd_stages) * tile,                                              \
           [&] { PICK(attention_fwd, DD, S)(q.data(), k.data(), v.data(), out.data(), lse.data(), st, de, id, a); })
        if constexpr (std::is_same_v<T, __half>) {
            if (D == 64) FWD(64, f16); else if (D == 128) FWD(128, f16); else FWD(256, f16);
        } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
            if (D == 64) FWD(64, bf16); else if (D == 128) FWD(128, bf16); else FWD(256, bf16);
        }
    }
    // delta = rowsum(dO * O) is written by the dq pass and read by the dk / dv pass.
    if (rows) {
        const int w = C::ROW_WARPS;
        auto f = [](auto& x) { return reinterpret_cast<float*>(x.data()); };
        auto cf = [](const auto& x) { return reinterpret_cast<const float*>(x.data()); };
        launch(blocks((c.b * c.h * c.m + w - 1) / w), w * 32, 0, [&] {
            attention_dq_rows_f32(cf(q), cf(k), cf(v), cf(go), cf(out), lse.data(), delta.data(), f(dq), nullptr, nullptr,
                                  st, de, id, a);
        });
        launch(blocks((c.b * c.hk * c.n + w - 1) / w), w * 32, 0, [&] {
            attention_dkdv_rows_f32(cf(q), cf(k), cf(v), cf(go), cf(out), lse.data(), delta.data(), nullptr, f(dk),
                                    f(dvv), st, de, id, a);
        });
    } else {
        const size_t dq_smem = (2 * qtiles + 2 * dq_stages) * tile,
                     dkdv_smem = (2 + 2 * dkdv_stages) * tile + 2 * dkdv_stages * 64 * 4;
        const Dim3 dkdv_grid{static_cast<uint32_t>(c.b * c.hk * ct), D > 128 ? 2u : 1u, 1};
        std::vector<float> dq_accum(static_cast<size_t>(c.b * c.h * rt * 64 * 128), 0.f);
#define ONE_PASS(S)                                                                                                    \
    do {                                                                                                            \
        launch(blocks((c.b * c.h * c.m + C::ROW_WARPS - 1) / C::ROW_WARPS), C::ROW_WARPS * 32, 0, [&] {           \
            attention_delta_##S(q.data(), k.data(), v.data(), go.data(), out.data(), lse.data(), delta.data(),       \
                                nullptr, dk.data(), dvv.data(), st, de, id, a);                                     \
        });                                                                                                         \
        const size_t smem1 = (2 * 128 + (2 * C::ONE_PASS_STAGES + 4) * 64) * 128 * sizeof(T) +                     \
                             2 * C::ONE_PASS_STAGES * 64 * 4;                                                  \
        launch(blocks(c.b * c.hk * ((c.n + 127) / 128)), 256, smem1, [&] {                                          \
            PICK(attention_bwd, 128, S)(q.data(), k.data(), v.data(), go.data(), out.data(), lse.data(),               \
                                         delta.data(), nullptr, dk.data(), dvv.data(), st, de, id, a,              \
                                         dq_accum.data());                                                         \
        });                                                                                                         \
        launch(blocks((dq_accum.size() / 4 + 255) / 256), 256, 0, [&] {                                            \
            attention_dq_rows_d128_##S(reinterpret_cast<const float4*>(dq_accum.data()), dq.data(), a);              \
        });                                                                                                         \
    } while (0)
#define BWD(DD, S)                                                                                                 \
    do {                                                                                                            \
        launch(blocks(query_blocks), 128, dq_smem, [&] {                                                          \
            PICK(attention_dq, DD, S)(q.data(), k.data(), v.data(), go.data(), out.data(), lse.data(), delta.data(),    \
                                     dq.data(), dk.data(), dvv.data(), st, de, id, a);                     \
        });                                                                                                         \
        launch(dkdv_grid, 128, dkdv_smem, [&] {                                                                     \
            PICK(attention_dkdv, DD, S)(q.data(), k.data(), v.data(), go.data(), out.data(), lse.data(), delta.data(), \
                                       dq.data(), dk.data(), dvv.data(), st, de, id, a);                   \
        });                                                                                                         \
    } while (0)
        if constexpr (std::is_same_v<T, __half>) {
            if (one_pass) ONE_PASS(f16); else if (D == 64) BWD(64, f16); else if (D == 128) BWD(128, f16); else BWD(256, f16);
        } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
            if (one_pass) ONE_PASS(bf16); else if (D == 64) BWD(64, bf16); else if (D == 128) BWD(128, bf16); else BWD(256, bf16);
        }
    }
    if (g_token_major) {  // back to head-major for the checks
        out = move_heads(out, c.b, c.h, c.m, pdv, false);
        go = go_head_major;
        dq = move_heads(dq, c.b, c.h, c.m, pd, false);
        dk = move_heads(dk, c.b, c.hk, c.n, pd, false);
        dvv = move_heads(dvv, c.b, c.hk, c.n, pdv, false);
    }
    // The dq pass's delta against rowsum(dO * O) of the rounded output.
    int delta_failures = 0;
    for (int64_t r = 0; r < c.b * c.h * c.m; ++r) {
        double want = 0;
        for (int64_t x = 0; x < pdv; ++x) want += static_cast<double>(Host<T>::to(out[r * pdv + x])) * Host<T>::to(go[r * pdv + x]);
        if (!(std::abs(delta[r] - want) <= 1e-4 * (1 + std::abs(want)))) {
            std::printf("  FAIL  delta row %lld: got %g, want %g\n", static_cast<long long>(r), delta[r], want);
            ++delta_failures;
            break;
        }
    }

    // The f64 reference.
    const int64_t group = c.h / c.hk;
    std::vector<double> r_out(out.size(), 0.0), r_lse(lse.size()), r_dq(q.size(), 0.0), r_dk(k.size(), 0.0),
        r_dv(v.size(), 0.0);
    auto Q = [&](int64_t bh, int64_t i, int64_t x) { return Host<T>::to(q[(bh * c.m + i) * pd + x]); };
    auto K = [&](int64_t bk, int64_t j, int64_t x) { return Host<T>::to(k[(bk * c.n + j) * pd + x]); };
    auto V = [&](int64_t bk, int64_t j, int64_t x) { return Host<T>::to(v[(bk * c.n + j) * pdv + x]); };
    auto G = [&](int64_t bh, int64_t i, int64_t x) { return Host<T>::to(go[(bh * c.m + i) * pdv + x]); };
    for (int64_t bi = 0; bi < c.b; ++bi)
        for (int64_t hi = 0; hi < c.h; ++hi) {
            const int64_t bh = bi * c.h + hi, bk = bi * c.hk + hi / group;
            for (int64_t i = 0; i < c.m; ++i) {
                std::vector<double> s(c.n, -INFINITY);
                double mx = -INFINITY;
                for (int64_t j = 0; j < c.n; ++j)
                    if (visible(bi, i, j)) {
                        double dot = 0;
                        for (int64_t x = 0; x < pd; ++x) dot += Q(bh, i, x) * K(bk, j, x);
                        s[j] = scale * dot;
                        mx = std::max(mx, s[j]);
                    }
                if (mx == -INFINITY) { r_lse[bh * c.m + i] = -INFINITY; continue; }
                double sum = 0;
                for (int64_t j = 0; j < c.n; ++j) sum += std::exp(s[j] - mx);
                r_lse[bh * c.m + i] = mx + std::log(sum);
                std::vector<double> p(c.n), dp(c.n, 0.0);
                double dl = 0;
                for (int64_t j = 0; j < c.n; ++j) {
                    p[j] = std::exp(s[j] - mx) / sum;
                    for (int64_t x = 0; x < pdv; ++x) {
                        r_out[(bh * c.m + i) * pdv + x] += p[j] * V(bk, j, x);
                        dp[j] += G(bh, i, x) * V(bk, j, x);
                    }
                    dl += p[j] * dp[j];
                }
                for (int64_t j = 0; j < c.n; ++j) {
                    const double ds = p[j] * (dp[j] - dl);
                    for (int64_t x = 0; x < pdv; ++x) r_dv[(bk * c.n + j) * pdv + x] += p[j] * G(bh, i, x);
                    for (int64_t x = 0; x < pd; ++x) {
                        r_dq[(bh * c.m + i) * pd + x] += scale * ds * K(bk, j, x);
                        r_dk[(bk * c.n + j) * pd + x] += scale * ds * Q(bh, i, x);
                    }
                }
            }
        }
    const double tol_out = rows ? 2e-5 : std::is_same_v<T, __half> ? 4e-3 : 3e-2;
    const double tol_grad = rows ? 1e-4 : std::is_same_v<T, __half> ? 1e-2 : 5e-2;
    int failures = delta_failures;
    auto compare = [&](const char* what, auto&& got, const std::vector<double>& want, double tol) {
        double worst = 0;
        size_t at = 0;
        for (size_t i = 0; i < want.size(); ++i) {
            const double g = got(i), e = want[i];
            double err;
            if (std::isinf(e)) err = (g == e) ? 0 : INFINITY;
            else err = std::abs(g - e) / std::max(std::abs(e), 1.0);
            if (!(err <= worst)) { worst = std::isnan(err) ? INFINITY : err; at = i; }
        }
        const bool ok = worst <= tol;
        failures += !ok;
        std::printf("  %-5s %-4s %s worst %.2e at %zu (got %g, want %g)\n", ok ? "ok" : "FAIL", dtype_name<T>(), what,
                    worst, at, got(at), want[at]);
    };
    std::printf("%s%s [b %lld h %lld hk %lld m %lld n %lld d %lld dv %lld, D %lld]\n", c.name.c_str(), runs ? (one_pass ? " (runs, one pass)" : " (runs)") : (one_pass ? " (one pass)" : ""), (long long)c.b,
                (long long)c.h, (long long)c.hk, (long long)c.m, (long long)c.n, (long long)c.d, (long long)c.dv,
                (long long)(rows ? 0 : D));
    compare("out", [&](size_t i) { return Host<T>::to(out[i]); }, r_out, tol_out);
    compare("lse", [&](size_t i) { return static_cast<double>(lse[i]); }, r_lse, std::max(tol_out, 1e-5));
    compare("dq", [&](size_t i) { return Host<T>::to(dq[i]); }, r_dq, tol_grad);
    compare("dk", [&](size_t i) { return Host<T>::to(dk[i]); }, r_dk, tol_grad);
    compare("dv", [&](size_t i) { return Host<T>::to(dvv[i]); }, r_dv, tol_grad);
    return failures;
}

int main(int argc, char** argv) {
    std::setvbuf(stdout, nullptr, _IONBF, 0);
    const bool quick = argc > 1 && std::string(argv[1]) == "quick";
    const bool only_one_pass = argc > 1 && std::string(argv[1]) == "one_pass";
    g_token_major = argc > 1 && std::string(argv[1]) == "tokens";
    std::vector<Case> cases = {
        {"causal", 2, 2, 1, 130, 130, 64, 64, CAUSAL},
        {"full, m < n, d != dv", 1, 2, 2, 70, 150, 72, 40, FULL},
        {"window 37, m < n", 1, 2, 1, 67, 200, 24, 24, WINDOW, 37},
        {"documents causal", 2, 2, 2, 131, 131, 16, 16, DOCS, 0, true},
        {"documents", 1, 3, 1, 100, 100, 40, 40, DOCS, 0, false},
        {"dense", 1, 2, 1, 90, 77, 32, 32, DENSE},
        {"causal m > n", 1, 1, 1, 150, 7, 8, 8, CAUSAL},
        {"window 0", 1, 1, 1, 9, 9, 8, 8, WINDOW, 0},
        {"causal d 128, grouped", 1, 2, 1, 130, 130, 128, 128, CAUSAL},
        {"dense d 96", 1, 2, 1, 70, 90, 96, 88, DENSE},
        {"documents causal d 128, grouped", 1, 4, 2, 200, 200, 128, 120, DOCS, 0, true},
        {"documents d 96", 2, 1, 1, 150, 150, 96, 96, DOCS, 0, false},
        {"documents d 200", 1, 1, 1, 100, 100, 200, 136, DOCS, 0, true},
        {"causal d 200", 1, 1, 1, 70, 70, 200, 136, CAUSAL},
    };
    int failures = 0;
    uint64_t seed = 1;
    for (const auto& c : cases) {
        if (quick && c.d > 128) continue;
        if (!only_one_pass) {
        failures += run_case<__nv_bfloat16>(c, seed++);
        failures += run_case<__half>(c, seed++);
        failures += run_case<float>(c, seed++);
        if (c.kind == DOCS && c.m == c.n) {  // the runs instances
            failures += run_case<__nv_bfloat16>(c, seed++, true);
            failures += run_case<__half>(c, seed++, true);
        }
        }
        if (std::max(c.d, c.dv) > 64 && std::max(c.d, c.dv) <= 128) {  // the one-pass backward
            failures += run_case<__nv_bfloat16>(c, seed++, false, true);
            failures += run_case<__half>(c, seed++, false, true);
            if (c.kind == DOCS && c.m == c.n) {  // its runs instance
                failures += run_case<__nv_bfloat16>(c, seed++, true, true);
                failures += run_case<__half>(c, seed++, true, true);
            }
        }
    }
    std::printf("%s: %d failing checks\n", failures ? "FAILED" : "all ok", failures);
    return failures ? 1 : 0;
}
