// Argument checks shared by spectrio's custom ops (raised before any parallel region: an
// exception must not leave an OpenMP region).
#pragma once

#include "paddle/extension.h"

namespace spectrio {

inline void check_f32_cpu(const paddle::Tensor& t, const char* what) {
  PD_CHECK(t.is_cpu(), what, ": a CPU tensor is expected");
  PD_CHECK(t.dtype() == paddle::DataType::FLOAT32, what, ": float32 is expected");
}

}  // namespace spectrio
