// The CPU kernels as one translation unit, the only source `cluster/model/cpu_kernels.py` builds.
//
// ATen's and torch's headers take most of a unit's compile time (about 10 s of each), so the sources
// are compiled together, the headers once per instruction set: one variant's build took 59 s of CPU
// as four units and 31 s as this one. Each source keeps its own anonymous namespace and registration.
#include "decode_attention.cpp"
#include "prefill_attention.cpp"
#include "quantized_linear.cpp"
#include "race_noise.cpp"
#include "skinny_linear.cpp"
#include "decode_layer.cpp"  // calls the kernels above
