"""Tandem's cluster core: what every role shares.

The config schema (`config`), the model's architecture (`arch`), the Llama-family forward pass over
a paged KV cache (`model`, `attention`), strict loading of a Hugging Face model folder (`loader`,
`tokenizer`), random-weight model folders for tests and benchmarks (`model_builder`), offline
generation (`generate`) and the `tandem` command line (`cli`). Imports nothing from the workers or
the router.
"""
