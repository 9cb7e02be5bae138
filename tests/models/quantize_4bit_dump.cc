// Not a unit test: Strata's 4-bit quantization (models/ops/quantize_4bit.h) of raw values, written
// to files for tests/python/test_quantize_4bit.py, which compares them with its bitsandbytes
// reference (tests/python/bnb_reference.py).
//
//   quantize_4bit_dump quantize nf4|fp4 0|1 IN.f32 PREFIX
//       IN.f32: n >= 1 little-endian fp32 values. Writes PREFIX.record (the packed record),
//       PREFIX.f32, PREFIX.bf16 and PREFIX.fp16 (Dequantize4bit's n values: fp32, and the bits
//       of bf16 and fp16), and prints the layout as one JSON line on stdout.
//   quantize_4bit_dump maps PREFIX
//       Writes PREFIX.nf4 and PREFIX.fp4 (Quant4Map, 16 fp32 each) and PREFIX.map8 (DynamicMap8,
//       256 fp32).
// Exit status 0, or 2 with a message on stderr for bad arguments or files.
#include <cstdio>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include "base/dtype.h"
#include "models/ops/quantize_4bit.h"

namespace {

using namespace strata;               // NOLINT: a test program
using namespace strata::models::ops;  // NOLINT

int Fail(const std::string& message) {
  std::cerr << "quantize_4bit_dump: " << message << "\n";
  return 2;
}

bool WriteFile(const std::string& path, const void* data, size_t size_bytes) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(size_bytes));
  return static_cast<bool>(f);
}

template <typename S>
bool DequantizeTo(const Quant4Layout& l, const std::vector<std::byte>& record,
                  const std::string& path) {
  std::vector<S> out(l.n);
  Dequantize4bit(l, record.data(), out.data());
  return WriteFile(path, out.data(), out.size() * sizeof(S));
}

int Quantize(const std::string& type_name, const std::string& dq, const std::string& in,
             const std::string& prefix) {
  const StatusOr<Quant4Type> type = ParseQuant4Type(type_name);
  if (!type.ok()) return Fail(type.status().ToString());
  if (dq != "0" && dq != "1") return Fail("double quantization must be 0 or 1, got " + dq);
  std::ifstream f(in, std::ios::binary | std::ios::ate);
  if (!f) return Fail("cannot open " + in);
  const std::streamsize size = f.tellg();
  if (size < 4 || size % 4 != 0) return Fail(in + ": need a positive multiple of 4 bytes");
  std::vector<float> x(size / 4);
  f.seekg(0);
  if (!f.read(reinterpret_cast<char*>(x.data()), size)) return Fail("cannot read " + in);

  const Quant4Layout l =
      MakeQuant4Layout(static_cast<int64_t>(x.size()), {*type, /*double_quant=*/dq == "1"});
  std::vector<std::byte> record(l.total_bytes);
  Quantize4bit(l, x.data(), record.data());
  if (!WriteFile(prefix + ".record", record.data(), record.size()) ||
      !DequantizeTo<float>(l, record, prefix + ".f32") ||
      !DequantizeTo<Bf16>(l, record, prefix + ".bf16") ||
      !DequantizeTo<Fp16>(l, record, prefix + ".fp16")) {
    return Fail("cannot write the files of " + prefix);
  }
  std::cout << "{\"n\": " << l.n << ", \"blocks\": " << l.blocks
            << ", \"nested_blocks\": " << l.nested_blocks
            << ", \"codes_offset\": " << l.codes_offset << ", \"codes_bytes\": " << l.codes_bytes
            << ", \"absmax_offset\": " << l.absmax_offset
            << ", \"absmax_bytes\": " << l.absmax_bytes
            << ", \"nested_absmax_offset\": " << l.nested_absmax_offset
            << ", \"nested_absmax_bytes\": " << l.nested_absmax_bytes
            << ", \"offset_offset\": " << l.offset_offset << ", \"total_bytes\": " << l.total_bytes
            << "}\n";
  return 0;
}

int Maps(const std::string& prefix) {
  const auto nf4 = Quant4Map(Quant4Type::kNf4);
  const auto fp4 = Quant4Map(Quant4Type::kFp4);
  const auto map8 = DynamicMap8();
  if (!WriteFile(prefix + ".nf4", nf4.data(), nf4.size_bytes()) ||
      !WriteFile(prefix + ".fp4", fp4.data(), fp4.size_bytes()) ||
      !WriteFile(prefix + ".map8", map8.data(), map8.size_bytes())) {
    return Fail("cannot write the files of " + prefix);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 5 && args[0] == "quantize")
    return Quantize(args[1], args[2], args[3], args[4]);
  if (args.size() == 2 && args[0] == "maps") return Maps(args[1]);
  return Fail("usage: quantize_4bit_dump quantize nf4|fp4 0|1 IN.f32 PREFIX | maps PREFIX");
}
