"""Hugging Face Llama import and export (`python -m resilient_jax.hf export|config`).

Our decoder is a Llama: RMSNorm, rotary positions, a SwiGLU MLP, grouped-query attention, no
biases. What differs is only how parameters are stored (`layout.py`):

- Linear weights: ours are `[in, ..., out]` einsum kernels (`wq` is `[D, H, E]`), the PyTorch
  layout is `[out, in]` with heads flattened head-major (`q_proj.weight` is `[H*E, D]`).
- Rotary positions: `model.rotary` rotates the first half of a head's dims against the second
  half, which is Llama's rotate-half layout, so q/k rows need no permutation.
- Projections are split on both sides (separate q/k/v and gate/up), so nothing is fused or split.
- Tied embeddings: our tied output layer is `embed.T * d_model**-0.5`, Llama's tied one is
  `embed.T`. An export writes the scaled copy as an untied `lm_head` (exact: the same float32
  product our model computes), and an import recognises it bit for bit; a tied Llama imported
  into a tied config has the scale folded into the final norm.
- RMSNorm epsilon and the rotary base are config values (`rms_norm_eps`, `rope_theta`).
- Padding: an export's config.json has `pad_token_id: null`. transformers builds a Llama's
  embedding with `padding_idx=pad_token_id`, and that row's gradient is always zero; our padding
  token is end-of-text when the tokenizer has none of its own, a token every document ends with,
  so a model fine-tuned in PyTorch would never train it. The tokenizer's files and
  generation_config.json name the padding token.

`hf_config.py` maps config.json to our model section and back, `files.py` reads and writes
safetensors, `importer.py` puts a directory's weights onto a run's mesh, `exporter.py` writes the
newest verified checkpoint of a run as a directory.
"""
