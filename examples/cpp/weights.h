// A weightless package's weights blob: safetensors (an 8-byte little-endian header length, a JSON header, the raw
// little-endian tensor bytes), read with the strict JSON parser and checked against the constants the manifest signs
// (compiler/weights.py writes it; the SDK reads it the same way, client/sdk.py).
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Device.h>

#include <string>
#include <unordered_map>

#include "verify.h"

namespace aotc {

// The blob at `path` (already copied and its sha256 checked against the manifest) as FQN -> tensor on `device`, each
// with the dtype, shape and stride the manifest signs. Every signed constant must be in the header with that dtype
// and shape, and the header must hold nothing else; its offsets must lie inside the file. Throws Refused otherwise.
// With no signed constants (--insecure-skip-verify), every tensor of the header, contiguous.
std::unordered_map<std::string, at::Tensor> load_weights(const std::string& path, const Expected& want,
                                                         c10::Device device);

}  // namespace aotc
