// Registers the native CPU ops as torch.ops.loraplex.* (the Python side loads this library once).
#include <torch/library.h>

#include "ops.h"

TORCH_LIBRARY(loraplex, m) {
  m.def(
      "paged_attention(Tensor q, Tensor kv_cache, Tensor block_tables, Tensor seq_lens, Tensor query_start_loc, "
      "float scale) -> Tensor",
      &loraplex::paged_attention);
  m.def("add_rms_norm(Tensor(a!) x, Tensor? residual, Tensor weight, float eps) -> Tensor", &loraplex::add_rms_norm);
  m.def(
      "rope_kv_write(Tensor(a!) qkv, Tensor cos, Tensor signed_sin, Tensor(b!) storage, int layer, Tensor kv_rows, "
      "int num_heads, int num_kv_heads) -> ()",
      &loraplex::rope_kv_write);
  m.def("silu_mul(Tensor gate_up) -> Tensor", &loraplex::silu_mul);
  m.def(
      "sgmv_fused(Tensor x, Tensor storage, int layer_offset, Tensor token_ids, Tensor item_starts, "
      "Tensor row_start_a, Tensor row_start_b, Tensor ranks, Tensor row_addr, Tensor out_dims, Tensor out_offsets, "
      "Tensor(a!) y) -> ()",
      &loraplex::sgmv_fused);
  m.def("argmax_rows(Tensor logits) -> Tensor", &loraplex::argmax_rows);
  m.def("linear_panel_width() -> int", &loraplex::linear_panel_width);
  m.def("pack_linear_weight(Tensor weight) -> Tensor", &loraplex::pack_linear_weight);
  m.def("linear_packed(Tensor x, Tensor packed, Tensor? bias, int out_features, Tensor? scales=None) -> Tensor",
        &loraplex::linear_packed);
  m.def("linear_packed_silu_mul(Tensor x, Tensor packed, int intermediate, Tensor? scales=None) -> Tensor",
        &loraplex::linear_packed_silu_mul);
  m.def("linear_dot_available() -> bool", &loraplex::linear_dot_available);
  m.def("pack_linear_pairs(Tensor weight) -> Tensor", &loraplex::pack_linear_pairs);
  m.def("linear_dot(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor",
        &loraplex::linear_dot);
  m.def("linear_dot_silu_mul(Tensor x, Tensor packed, int intermediate) -> Tensor", &loraplex::linear_dot_silu_mul);
  m.def("linear_amx_available() -> bool", &loraplex::linear_amx_available);
  m.def("linear_amx(Tensor x, Tensor packed, Tensor? bias, int out_features) -> Tensor", &loraplex::linear_amx);
  m.def("linear_amx_silu_mul(Tensor x, Tensor packed, int intermediate) -> Tensor", &loraplex::linear_amx_silu_mul);
  m.def("linear_vnni_available() -> bool", &loraplex::linear_vnni_available);
  m.def("pack_linear_quads(Tensor weight) -> Tensor[]", &loraplex::pack_linear_quads);
  m.def(
      "linear_vnni(Tensor x, Tensor packed, Tensor offsets, Tensor? bias, int out_features, Tensor scales) -> Tensor",
      &loraplex::linear_vnni);
}
