// The oneDNN path of cpu::Conv2dForward / Conv2dBackward (runtime/engine/cpu_conv.h): fp32 convolution
// primitives (forward, backward-data, backward-weights with the bias gradient) on NCHW user
// tensors. oneDNN picks its own (blocked) layouts (format_tag::any); the user tensors are
// reordered into them and the results back, and every reorder is part of the call's time.
//
// Caching: the primitives, their reorders and the blocked copy of the input x live in the
// workspace's DnnlConv, built at the first call for a (shape, bias, thread count) and rebuilt
// only when one of those changes; the other blocked buffers (weights, output, gradients,
// oneDNN's scratchpad) are one arena per thread, shared by all layers. Weights are reordered
// at every forward (they change at every optimiser step; cheap: a few KiB), and again for the
// input gradient when oneDNN wants another layout there.
//
// Threading: Debian's libdnnl is built with DNNL_CPU_RUNTIME=OMP on libgomp, the OpenMP
// runtime of this build: its primitives run on omp_get_max_threads() threads of the calling
// thread (what the trainer sets with omp_set_num_threads), and the thread count is fixed in a
// primitive when it is created. For a fixed thread count oneDNN's CPU convolutions are
// run-to-run deterministic (tested in tests/runtime/nn/layers_test.cc).
//
// Builds without oneDNN (CPD_WITH_DNNL = 0) compile this file too: Available() is false there.
#pragma once

#include <string>

#include "runtime/engine/conv_shape.h"

namespace cpd::runtime::cpu::onednn {

// Whether this build has oneDNN and its CPU engine could be created (checked once).
bool Available();

// As cpu::Conv2dForward / Conv2dBackward. They return false, having written nothing, when
// oneDNN has no implementation for the shape (the caller then takes another path); errors
// from oneDNN throw std::runtime_error naming the shape. REQUIRED: Available(), and not called
// from inside an OpenMP parallel region. Conv2dBackward reuses the blocked x of the last
// forward on the same workspace when x and w are the same pointers (see cpu::Conv2dBackward).
bool Conv2dForward(const ConvShape& s, const float* x, const float* w, const float* bias, float* y,
                   ConvWorkspace* ws);
bool Conv2dBackward(const ConvShape& s, const float* x, const float* w, const float* dy, float* dx,
                    float* dw, float* db, ConvWorkspace* ws);

// oneDNN's implementation names for the three primitives of `s` ("fwd jit:avx2, bwd_data
// jit:avx2, bwd_weights jit:avx2"), or why there are none. For benchmarks and reports.
std::string Describe(const ConvShape& s, bool bias);

}  // namespace cpd::runtime::cpu::onednn
