"""The model: a Llama-family decoder over a paged KV cache, and everything needed to load and run it.

`arch` reads config.json into `ModelArch`; `causal_lm` is the forward pass (`CausalLM`), `attention`
the paged KV layout, attention metadata and attention itself; `cpu_kernels` builds and calls the
C++ kernels of `csrc/` (few-row products, decode and prefill attention); `weights` holds the tables
the loader and the GGUF import share (dtype names, weight file names, Hugging Face name -> parameter);
`loader` loads a model folder strictly (every tensor named, shaped and used), `gguf` imports a GGUF
file into one (the edges call its `model_folder`; the loader refuses a `.gguf` file), and
`tokenizer` reads the tokenizer, chat template and stop tokens; `quant` holds the weight-only
int8/int4 modules and `quality` measures what they cost; `builder` writes random-weight folders
for tests and benchmarks. Imports torch and the top-level `cluster` modules only: nothing from
`cluster.engine`, `cluster.kv` or `cluster.pools`, no gRPC, no Ray.
"""
