// A whole decode step of a dense llama-family model in one call: every layer's norms,
// quantized projections, rotary, KV write, paged attention and SwiGLU, run back to back in
// C++ (kernels.h), so the step pays Python's per-op dispatch once instead of ~40 times per
// layer. The same functions in the same order as the Python path
// (common/models/llama.py with common/engine/attention/cpp_backend.py), so its results are
// bit for bit that path's; common/models/quant/fused_decode.py builds it and says when it
// applies (decode-only steps, float32 KV, single-part C++-kernel projections).
// FP8 projections quantize their input as common/models/quant/fp8.py does, with the same
// float32 arithmetic as its ATen operations, so that too is bit for bit the Python path.
//
// B = sequences (one new token each), H = hidden size, Hq / Hkv = query / kv heads, D = head
// dim, N = cache blocks, S = block size, M = blocks per sequence.

#include <c10/util/Float8_e4m3fn.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "kernels.h"

namespace {

// One quantized projection: Q4 (codes, scales, mins) or Q8 (codes, scales), in the rows or
// the x16 layout (kernels/cpu/quant.py), and a bias.
// A KQx16 weight (kernels/cpu/kquant.py): GGUF's K-quants and checkpoints' integer codes.
struct KqParts {
  torch::Tensor lo;
  std::optional<torch::Tensor> hi;
  int64_t lo_width = 4, hi_width = 0, code_bias = 0, group_size = 32, block_size = 256;
  torch::Tensor d;
  std::optional<torch::Tensor> sc, dmin, m;  // sc, m absent: half scales (kquant.py)
  double sign = -1.0;
  bool int8_tokens = false;
  std::optional<torch::Tensor> perm;  // act order: the kernel reads x[:, perm]
};

// An FP8 E4M3 weight (common/models/quant/fp8.py) and how its input is quantized:
// activations 0 none, 1 per token (dynamic), 2 per tensor (the static input_scale).
struct Fp8Parts {
  torch::Tensor packed, kernel_scale;  // codes 16 rows interleaved; float32 [N]
  int64_t activations = 0;
  std::optional<torch::Tensor> input_scale;

  // fp8.py's fake_quantize_e4m3 with token_scales or the input scale, in one pass over each
  // row and the same float32 arithmetic as its ATen operations (the step a float32 division
  // of the row's max |x| by 448, float32's epsilon for a zero row; each x divided by it,
  // clamped to +-448, rounded to E4M3 by c10's conversion, multiplied back).
  torch::Tensor quantize_input(const torch::Tensor& x) const {
    if (activations == 0) return x;
    TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
                "FP8 projections take contiguous float32 [B, K] inputs");
    const int64_t rows = x.size(0), k = x.size(1);
    torch::Tensor out = torch::empty_like(x);
    const float* xp = x.data_ptr<float>();
    float* op = out.data_ptr<float>();
    const float fixed = activations == 2 ? input_scale->item<float>() : 0.f;
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = xp + r * k;
      float scale = fixed;
      if (activations == 1) {
        float amax = 0.f;
        for (int64_t j = 0; j < k; ++j) amax = std::max(amax, std::fabs(xr[j]));
        scale = amax / kE4m3Max;
        if (scale == 0.f) scale = std::numeric_limits<float>::epsilon();
      }
      float* orow = op + r * k;
      for (int64_t j = 0; j < k; ++j) {
        const float v = std::min(std::max(xr[j] / scale, -kE4m3Max), kE4m3Max);
        orow[j] = static_cast<float>(c10::Float8_e4m3fn(v)) * scale;
      }
    }
    return out;
  }

  static constexpr float kE4m3Max = 448.0f;
};

struct Projection {
  bool q4 = true, x16 = false;
  torch::Tensor qweight, scales, mins;
  int64_t group_size = 32, num_rows = 0;
  std::optional<torch::Tensor> bias;
  std::optional<KqParts> kq;
  std::optional<Fp8Parts> fp8;
  std::vector<Projection> parts;  // a projection of several weights: outputs concatenated

  torch::Tensor operator()(const torch::Tensor& x, int64_t act_bits) const {
    torch::Tensor out;
    if (!parts.empty()) {
      std::vector<torch::Tensor> outs;
      outs.reserve(parts.size());
      for (const Projection& part : parts) outs.push_back(part(x, act_bits));
      out = torch::cat(outs, 1);
    } else if (kq.has_value()) {
      const KqParts& w = *kq;
      const torch::Tensor xin = w.perm.has_value() ? x.index_select(1, *w.perm).contiguous() : x;
      out = pdserve_cpu::kq_x16_matmul(xin, w.lo, w.hi, w.lo_width, w.hi_width, w.code_bias,
                                       w.group_size, w.block_size, w.d, w.sc, w.dmin, w.m,
                                       w.sign, num_rows, w.int8_tokens, act_bits);
    } else if (fp8.has_value()) {
      out = pdserve_cpu::fp8_x16_matmul(fp8->quantize_input(x), fp8->packed, fp8->kernel_scale,
                                        num_rows);
    } else if (x16) {
      out = q4 ? pdserve_cpu::q4x16_matmul(x, qweight, scales, mins, group_size, num_rows,
                                           act_bits)
               : pdserve_cpu::q8x16_matmul(x, qweight, scales, group_size, num_rows, act_bits);
    } else {
      out = q4 ? pdserve_cpu::q4_matmul(x, qweight, scales, mins, group_size, act_bits)
               : pdserve_cpu::q8_matmul(x, qweight, scales, group_size, act_bits);
    }
    if (bias.has_value()) out.add_(*bias);
    return out;
  }
};

Projection make_projection(bool q4, bool x16, torch::Tensor qweight, torch::Tensor scales,
                           std::optional<torch::Tensor> mins, int64_t group_size,
                           int64_t num_rows, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(!q4 || mins.has_value(), "a Q4 projection needs its mins");
  return Projection{q4, x16, std::move(qweight), std::move(scales),
                    mins.has_value() ? *mins : torch::Tensor(), group_size, num_rows,
                    std::move(bias)};
}

Projection make_kq_projection(torch::Tensor lo, std::optional<torch::Tensor> hi,
                              int64_t lo_width, int64_t hi_width, int64_t code_bias,
                              int64_t group_size, int64_t block_size, torch::Tensor d,
                              std::optional<torch::Tensor> sc, std::optional<torch::Tensor> dmin,
                              std::optional<torch::Tensor> m, double sign, int64_t num_rows,
                              bool int8_tokens, std::optional<torch::Tensor> perm,
                              std::optional<torch::Tensor> bias) {
  Projection p;
  p.num_rows = num_rows;
  p.bias = std::move(bias);
  p.kq = KqParts{std::move(lo), std::move(hi), lo_width, hi_width, code_bias, group_size,
                 block_size, std::move(d), std::move(sc), std::move(dmin), std::move(m),
                 sign, int8_tokens, std::move(perm)};
  return p;
}

Projection make_fp8_projection(torch::Tensor packed, torch::Tensor kernel_scale,
                               int64_t activations, std::optional<torch::Tensor> input_scale,
                               int64_t num_rows, std::optional<torch::Tensor> bias) {
  TORCH_CHECK(activations >= 0 && activations <= 2, "activations must be 0, 1 or 2");
  TORCH_CHECK(activations != 2 || input_scale.has_value(), "static activations need input_scale");
  Projection p;
  p.num_rows = num_rows;
  p.bias = std::move(bias);
  p.fp8 = Fp8Parts{std::move(packed), std::move(kernel_scale), activations, std::move(input_scale)};
  return p;
}

Projection make_joined_projection(std::vector<Projection> parts,
                                  std::optional<torch::Tensor> bias) {
  TORCH_CHECK(!parts.empty(), "a joined projection needs parts");
  Projection p;
  for (const Projection& part : parts) p.num_rows += part.num_rows;
  p.parts = std::move(parts);
  p.bias = std::move(bias);
  return p;
}

struct Layer {
  Projection qkv, o, gate_up, down;
  torch::Tensor input_norm, post_norm;
  std::optional<torch::Tensor> q_norm, k_norm;  // qwen3
  torch::Tensor k_cache, v_cache;  // [N, S, Hkv, D] float32 / float16 / bfloat16, this layer's
};

class DecodeModel {
 public:
  DecodeModel(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double eps,
              double scale, int64_t window, int64_t act_bits, torch::Tensor final_norm)
      : hq_(num_heads), hkv_(num_kv_heads), d_(head_dim), eps_(eps), scale_(scale),
        window_(window), act_bits_(act_bits), final_norm_(std::move(final_norm)) {}

  void add_layer(Projection qkv, Projection o, Projection gate_up, Projection down,
                 torch::Tensor input_norm, torch::Tensor post_norm,
                 std::optional<torch::Tensor> q_norm, std::optional<torch::Tensor> k_norm,
                 torch::Tensor k_cache, torch::Tensor v_cache) {
    layers_.push_back(Layer{std::move(qkv), std::move(o), std::move(gate_up), std::move(down),
                            std::move(input_norm), std::move(post_norm), std::move(q_norm),
                            std::move(k_norm), std::move(k_cache), std::move(v_cache)});
  }

  // h: the embeddings [B, H] (consumed: it becomes the residual stream). Returns the final
  // normed hidden states [B, H].
  torch::Tensor forward(torch::Tensor h, const torch::Tensor& positions,
                        const torch::Tensor& cos_sin, const torch::Tensor& slots,
                        const torch::Tensor& block_tables, const torch::Tensor& seq_lens) {
    TORCH_CHECK(!layers_.empty(), "a decode model needs at least one layer");
    TORCH_CHECK(h.dim() == 2 && h.is_contiguous(), "h must be contiguous [B, H]");
    const int64_t b = h.size(0);
    const int64_t q_size = hq_ * d_, kv_size = hkv_ * d_;
    torch::Tensor residual;
    for (Layer& layer : layers_) {
      torch::Tensor x;
      if (!residual.defined()) {
        residual = h;
        x = pdserve_cpu::rms_norm(h, layer.input_norm, eps_);
      } else {
        x = pdserve_cpu::add_rms_norm_(h, residual, layer.input_norm, eps_);
      }
      torch::Tensor qkv = layer.qkv(x, act_bits_);  // [B, (Hq + 2 Hkv) D]
      torch::Tensor q = qkv.narrow(1, 0, q_size).view({b, hq_, d_});
      torch::Tensor k = qkv.narrow(1, q_size, kv_size).view({b, hkv_, d_});
      torch::Tensor v = qkv.narrow(1, q_size + kv_size, kv_size).view({b, hkv_, d_});
      if (layer.q_norm.has_value() && layer.k_norm.has_value()) {
        q = pdserve_cpu::rms_norm(q.reshape({-1, d_}), *layer.q_norm, eps_).view({b, hq_, d_});
        k = pdserve_cpu::rms_norm(k.reshape({-1, d_}), *layer.k_norm, eps_).view({b, hkv_, d_});
      }
      pdserve_cpu::rotary_(q, positions, cos_sin);
      pdserve_cpu::rotary_(k, positions, cos_sin);
      pdserve_cpu::write_kv(k, v, layer.k_cache, layer.v_cache, slots);
      torch::Tensor attn = pdserve_cpu::paged_decode_attention(
          q, layer.k_cache, layer.v_cache, block_tables, seq_lens, scale_, window_);
      torch::Tensor o = layer.o(attn.reshape({b, q_size}), act_bits_);
      x = pdserve_cpu::add_rms_norm_(o, residual, layer.post_norm, eps_);
      h = layer.down(pdserve_cpu::silu_and_mul(layer.gate_up(x, act_bits_)), act_bits_);
    }
    return pdserve_cpu::add_rms_norm_(h, residual, final_norm_, eps_);
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  int64_t hq_, hkv_, d_;
  double eps_, scale_;
  int64_t window_, act_bits_;
  torch::Tensor final_norm_;
  std::vector<Layer> layers_;
};

}  // namespace

void register_decode_model(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Projection>(m, "Projection");
  m.def("projection", &make_projection, py::arg("q4"), py::arg("x16"), py::arg("qweight"),
        py::arg("scales"), py::arg("mins"), py::arg("group_size"), py::arg("num_rows"),
        py::arg("bias"),
        "one quantized projection (Q4 when q4, else Q8; the x16 layout when x16) for "
        "DecodeModel");
  m.def("kq_projection", &make_kq_projection, py::arg("lo"), py::arg("hi"), py::arg("lo_width"),
        py::arg("hi_width"), py::arg("code_bias"), py::arg("group_size"), py::arg("block_size"),
        py::arg("d"), py::arg("sc"), py::arg("dmin"), py::arg("m"), py::arg("sign"),
        py::arg("num_rows"), py::arg("int8_tokens"), py::arg("perm"), py::arg("bias"),
        "one KQx16 projection (kernels/cpu/kquant.py) for DecodeModel");
  m.def("fp8_projection", &make_fp8_projection, py::arg("packed"), py::arg("kernel_scale"),
        py::arg("activations"), py::arg("input_scale"), py::arg("num_rows"), py::arg("bias"),
        "one FP8 E4M3 projection (common/models/quant/fp8.py; activations 0 none, 1 per "
        "token, 2 per tensor) for DecodeModel");
  m.def("joined_projection", &make_joined_projection, py::arg("parts"), py::arg("bias"),
        "a projection whose weights are several parts (bias-free), outputs concatenated");
  py::class_<DecodeModel>(m, "DecodeModel")
      .def(py::init<int64_t, int64_t, int64_t, double, double, int64_t, int64_t, torch::Tensor>(),
           py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("scale"), py::arg("window"), py::arg("act_bits"), py::arg("final_norm"))
      .def("add_layer", &DecodeModel::add_layer)
      .def("forward", &DecodeModel::forward, py::call_guard<py::gil_scoped_release>(),
           "embeddings [B, H] -> final normed hidden states [B, H], one decode step")
      .def_property_readonly("num_layers", &DecodeModel::num_layers);
}
