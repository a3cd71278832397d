// float32 matmuls for MindSpore's Custom(func_type="aot") on CPU, calling the OpenBLAS that numpy ships
// (numpy.libs/libopenblas64_*.so, ILP64 interface: 64-bit integers, symbol suffix "64_").
// Built and cached by mindrlhf/models/cpu_matmul.py; one entry point per transpose case of C = op(A) op(B).
#include <cstdint>
#include <cstring>
#include <vector>

extern "C" void cblas_sgemm64_(int order, int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                               const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
                               int64_t ldc);

namespace {
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112;

// params: a, b, c (2-D, row-major). ta/tb: whether A/B are stored transposed.
int Gemm(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, bool ta, bool tb) {
  if (nparam != 3 || ndims[0] != 2 || ndims[1] != 2 || ndims[2] != 2) return 1;
  for (int i = 0; i < 3; ++i) {
    if (std::strcmp(dtypes[i], "float32") != 0) return 2;
  }
  const int64_t m = shapes[2][0], n = shapes[2][1];
  const int64_t k = ta ? shapes[0][0] : shapes[0][1];
  if ((tb ? shapes[1][1] : shapes[1][0]) != k) return 3;
  auto *c = static_cast<float *>(params[2]);
  if (k == 0) {
    std::memset(c, 0, sizeof(float) * m * n);
    return 0;
  }
  if (m == 0 || n == 0) return 0;
  cblas_sgemm64_(kRowMajor, ta ? kTrans : kNoTrans, tb ? kTrans : kNoTrans, m, n, k, 1.0f,
                 static_cast<const float *>(params[0]), shapes[0][1], static_cast<const float *>(params[1]),
                 shapes[1][1], 0.0f, c, n);
  return 0;
}
// Output shape from the input shapes (MindSpore calls it for dynamic shapes too: -1 unknown dim, {-2} unknown rank).
std::vector<int64_t> OutShape(int *ndims, int64_t **shapes, bool ta, bool tb) {
  if (ndims[0] != 2 || ndims[1] != 2) return {-2};
  return {ta ? shapes[0][1] : shapes[0][0], tb ? shapes[1][0] : shapes[1][1]};
}
}  // namespace

// C++ shape inference (FuncNameInferShape): with it the op also runs in graphs compiled for dynamic shapes.
// The last argument is MindSpore's AotExtra*, unused here.
extern "C" std::vector<int64_t> MatMulNNInferShape(int *ndims, int64_t **shapes, void *) {
  return OutShape(ndims, shapes, false, false);
}
extern "C" std::vector<int64_t> MatMulNTInferShape(int *ndims, int64_t **shapes, void *) {
  return OutShape(ndims, shapes, false, true);
}
extern "C" std::vector<int64_t> MatMulTNInferShape(int *ndims, int64_t **shapes, void *) {
  return OutShape(ndims, shapes, true, false);
}

extern "C" int MatMulNN(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return Gemm(nparam, params, ndims, shapes, dtypes, false, false);
}
extern "C" int MatMulNT(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return Gemm(nparam, params, ndims, shapes, dtypes, false, true);
}
extern "C" int MatMulTN(int nparam, void **params, int *ndims, int64_t **shapes, const char **dtypes, void *, void *) {
  return Gemm(nparam, params, ndims, shapes, dtypes, true, false);
}
