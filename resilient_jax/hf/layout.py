"""Our parameter tree <-> Hugging Face Llama tensors in the PyTorch layout (see the package
docstring for the conventions). Pure numpy: no devices, no files."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from resilient_jax.config import BadInput
from resilient_jax.model import ModelConfig
from resilient_jax.model import layers as layers_lib

Path = tuple[str, ...]  # a leaf's keys in our params tree, e.g. ("layers", "attn", "wq")
EMBED, LM_HEAD, FINAL_NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
# Buffers some checkpoints carry that are recomputed, not learned.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class Tensor:
    ours: Path
    index: int | None  # the layer's index on a stacked leaf's leading axis (None: not stacked)
    hf: str
    hf_shape: tuple[int, ...]
    to_hf: Callable[[np.ndarray], np.ndarray]
    from_hf: Callable[[np.ndarray], np.ndarray]


def _same(x: np.ndarray) -> np.ndarray:
    return x


def _transposed(x: np.ndarray) -> np.ndarray:
    return x.T


def output_scale(m: ModelConfig) -> np.float32:
    """The factor of our tied output layer (`model.Transformer`): the float32 product our model
    computes is `embed * output_scale`."""
    return np.float32(m.d_model**-0.5)


def _projection_in(d: int, heads: int, e: int) -> tuple[Callable, Callable, tuple[int, int]]:
    """q/k/v: ours [D, heads, E]; PyTorch [heads*E, D], row h*E+e (heads-major, as Llama views
    its projections into heads)."""
    return (
        lambda w: w.reshape(d, heads * e).T,
        lambda w: w.T.reshape(d, heads, e),
        (heads * e, d),
    )


def _layer_tensors(m: ModelConfig, i: int) -> list[Tensor]:
    d, f, e = m.d_model, m.d_ff, m.head_dim
    place, hf = layers_lib.locate(m, i), f"model.layers.{i}"
    ours, at = place.path, place.index
    projections = [("wq", "q", m.num_heads), ("wk", "k", m.num_kv_heads)]
    projections.append(("wv", "v", m.num_kv_heads))
    out = []
    for name, proj, heads in projections:
        to_hf, from_hf, shape = _projection_in(d, heads, e)
        hf_name = f"{hf}.self_attn.{proj}_proj.weight"
        out.append(Tensor((*ours, "attn", name), at, hf_name, shape, to_hf, from_hf))
    out.append(
        Tensor(
            (*ours, "attn", "wo"),
            at,
            f"{hf}.self_attn.o_proj.weight",
            (d, m.num_heads * e),
            lambda w: w.reshape(m.num_heads * e, d).T,
            lambda w: w.T.reshape(m.num_heads, e, d),
        )
    )
    # The MLP kernels are [in, out]: a transpose each.
    for name, proj, shape in (("w_gate", "gate", (f, d)), ("w_up", "up", (f, d))):
        hf_name = f"{hf}.mlp.{proj}_proj.weight"
        out.append(Tensor((*ours, "mlp", name), at, hf_name, shape, _transposed, _transposed))
    hf_name = f"{hf}.mlp.down_proj.weight"
    out.append(Tensor((*ours, "mlp", "w_down"), at, hf_name, (d, f), _transposed, _transposed))
    for norm, theirs in (
        ("attn_norm", "input_layernorm"),
        ("mlp_norm", "post_attention_layernorm"),
    ):
        weight = f"{hf}.{theirs}.weight"
        out.append(Tensor((*ours, norm, "scale"), at, weight, (d,), _same, _same))
    return out


def tensors(m: ModelConfig) -> list[Tensor]:
    """Every tensor both sides store one for one (the output layer is `to_hf`/`from_hf`'s).

    BadInput for a mixture-of-experts model: a Llama directory has no place for experts."""
    if m.moe.num_experts:
        raise BadInput(
            f"model.moe.num_experts={m.moe.num_experts} is invalid here: Hugging Face Llama "
            "export and import cover dense models only (num_experts=0)"
        )
    out = [Tensor(("embed",), None, EMBED, (m.vocab_size, m.d_model), _same, _same)]
    for i in range(m.num_layers):
        out += _layer_tensors(m, i)
    out.append(Tensor(("final_norm", "scale"), None, FINAL_NORM, (m.d_model,), _same, _same))
    return out


def _leaf(params: Mapping[str, Any], path: Path, index: int | None = None) -> np.ndarray:
    node: Any = params
    for key in path:
        node = node[key]
    return np.asarray(node if index is None else node[index], dtype=np.float32)


def to_hf(params: Mapping[str, Any], m: ModelConfig) -> dict[str, np.ndarray]:
    """HF tensors (float32) from our params tree (host arrays). A tied model's output layer is
    written as the untied `lm_head` our model computes with."""
    out = {t.hf: t.to_hf(_leaf(params, t.ours, t.index)) for t in tensors(m)}
    if m.tie_embeddings:
        out[LM_HEAD] = _leaf(params, ("embed",)) * output_scale(m)
    else:
        out[LM_HEAD] = _leaf(params, ("unembed",)).T
    return out


def is_scaled_copy(lm_head: np.ndarray, embed: np.ndarray, m: ModelConfig) -> bool:
    """Whether an untied `lm_head` is our tied output layer, bit for bit at the precision it is
    stored in (what `to_hf` writes from parameters already in that precision)."""
    if lm_head.shape != embed.shape:
        return False
    scaled = (embed.astype(np.float32) * output_scale(m)).astype(lm_head.dtype)
    return np.array_equal(lm_head, scaled)


def shape_problems(
    shapes: Mapping[str, tuple[int, ...]], m: ModelConfig, hf_tied: bool
) -> list[str]:
    """Missing, unexpected or misshapen tensors, against what `m` needs."""
    wanted = {t.hf: t.hf_shape for t in tensors(m)}
    if not hf_tied:
        wanted[LM_HEAD] = (m.vocab_size, m.d_model)
    problems = [f"{name} is missing" for name in wanted if name not in shapes]
    problems += [
        f"{name} is {list(shapes[name])}, the config needs {list(shape)}"
        for name, shape in wanted.items()
        if name in shapes and tuple(shapes[name]) != shape
    ]
    extra = set(shapes) - set(wanted) - {LM_HEAD}
    problems += [
        f"{name} is not part of the config's model"
        for name in sorted(extra)
        if not name.endswith(IGNORED_SUFFIXES)
    ]
    return problems


Index = tuple[slice, ...]  # one device's block of a leaf, as `jax.make_array_from_callback` asks
# A leaf's loader: its blocks at several indices (this host's devices'), each tensor read once.
Loader = Callable[[list[Index]], list[np.ndarray]]


def from_hf(
    read: Callable[[str], np.ndarray], m: ModelConfig, hf_tied: bool, where: str
) -> dict[Path, Loader]:
    """A loader per leaf of our params tree (each reads its tensors when called). A stacked
    leaf's loader reads one layer at a time and keeps only the blocks asked for, so the host
    never holds a whole stack it does not hold shards of (a 7B model's [32, 4096, 11008]
    float32 gate is 5.8 GB).

    `read(name)` returns an HF tensor in its stored dtype; `hf_tied`: the HF model has no
    separate output layer. A tied config takes the input embedding; an untied HF output layer
    then must be the scaled copy an export writes (anything else is refused, BadInput, naming
    `where`), and a tied HF model's plain `embed.T` output gets our scale undone in the final
    norm.
    """
    by_leaf: dict[Path, list[Tensor]] = {}
    for t in tensors(m):
        by_leaf.setdefault(t.ours, []).append(t)
    loaders: dict[Path, Loader] = {}
    for path, stack in by_leaf.items():
        if stack[0].index is None:
            t = stack[0]
            loaders[path] = _whole(lambda t=t: t.from_hf(read(t.hf)))
        else:
            loaders[path] = _stacked(read, sorted(stack, key=lambda t: t.index))
    if not m.tie_embeddings:
        source = EMBED if hf_tied else LM_HEAD
        loaders[("unembed",)] = _whole(lambda: np.ascontiguousarray(read(source).T))
    elif hf_tied:
        # ours: norm(x) * s @ embed.T * scale == HF's norm(x) * w @ embed.T when s = w / scale
        loaders[("final_norm", "scale")] = _whole(
            lambda: read(FINAL_NORM).astype(np.float32) / output_scale(m)
        )
    else:
        loaders[("embed",)] = _whole(lambda: _tied_embedding(read, m, where))
    return loaders


def _whole(load: Callable[[], np.ndarray]) -> Loader:
    """A leaf read whole, cut into the blocks asked for."""
    return lambda indices: [value[index] for value in (load(),) for index in indices]


def _stacked(read: Callable[[str], np.ndarray], layers: list[Tensor]) -> Loader:
    """A stacked leaf's blocks: each layer read once, and its part of every block (the layers a
    block's first slice selects, cut to the rest of the index) kept."""

    def blocks(indices: list[Index]) -> list[np.ndarray]:
        parts: list[list[np.ndarray]] = [[] for _ in indices]
        for position, t in enumerate(layers):
            tensor = t.from_hf(read(t.hf))
            for part, index in zip(parts, indices, strict=True):
                if position in range(len(layers))[index[0]]:
                    part.append(tensor[index[1:]])
        return [np.stack(part) for part in parts]

    return blocks


def _tied_embedding(read: Callable[[str], np.ndarray], m: ModelConfig, where: str) -> np.ndarray:
    embed = read(EMBED)
    if not is_scaled_copy(read(LM_HEAD), embed, m):
        raise BadInput(
            f"{where} has an output layer (lm_head) of its own: set config.model.tie_embeddings="
            "False to import it"
        )
    return embed
