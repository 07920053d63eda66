"""Causal softmax attention and rotary embeddings, the math of the model's
attention layers (`layers.py`, `sink_attention.py`, `gemma4.py`):
functions of arrays, no parameters; and `set_head_sizes`, the head layout
every grouped-query attention module records."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x @ w in x's dtype (w is cast), accumulated in float32."""
  return jnp.dot(
      x, w.astype(x.dtype), preferred_element_type=jnp.float32
  ).astype(x.dtype)


def set_head_sizes(module, cfg) -> tuple[int, int, int, int]:
  """Records a `model_config.ModelConfig`'s head layout on an attention
  module (`num_heads` H, `num_kv_heads` Hkv, `head_dim` d and
  `rope_theta`) and returns (D, H, Hkv, d), the sizes its projections
  are built from."""
  d, h, hkv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  module.num_heads, module.num_kv_heads, module.head_dim = h, hkv, hd
  module.rope_theta = cfg.rope_theta
  return d, h, hkv, hd


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
  """Rotary embedding of x [B, T, H, d] (d even) at positions [T].

  Rotates the pairs (i, i + d/2), the layout of Llama, Qwen, Mixtral and
  the Hugging Face DeepSeek-V3 code.
  """
  return rope_with_frequencies(
      x, positions, rope_frequencies(x.shape[-1], theta)
  )


def rope_frequencies(head_dim: int, theta: float) -> jax.Array:
  """RoPE's inverse frequencies [head_dim / 2]: pair i turns at
  theta ** (-i / (head_dim / 2))."""
  half = head_dim // 2
  return theta ** (-jnp.arange(half, dtype=jnp.float32) / half)


def rope_with_frequencies(
    x: jax.Array, positions: jax.Array, freq: jax.Array, scale: float = 1.0
) -> jax.Array:
  """`rope`'s rotation of x [B, T, H, d] with the given frequencies
  [d / 2] (pair i turns by positions * freq[i]), cos and sin multiplied by
  `scale` (YaRN's attention scaling; 1 elsewhere)."""
  angle = positions.astype(jnp.float32)[:, None] * freq  # [T, d/2]
  cos = (scale * jnp.cos(angle))[None, :, None, :]
  sin = (scale * jnp.sin(angle))[None, :, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


# Queries per block of `causal_attention` on long sequences: the float32
# scores of all queries at once are [B, H, T, T], 8 GiB a sequence for
# DeepSeek-V3's 128 heads at T = 4096; a block of 512 holds 1 GiB.
QUERY_BLOCK = 512


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    query_block: int = QUERY_BLOCK,
    chunk_size: int = 0,
) -> jax.Array:
  """Causal softmax attention with grouped key/value heads.

  On a TPU, shapes that fit it run a Pallas attention kernel of JAX's,
  splash or flash (`tpu_flash_fits`, `tpu_attention_kernel`). Elsewhere,
  sequences longer than `query_block` (and a multiple of it) run one block
  of queries at a time, each against every key, rematerialised in the
  backward (`in_query_blocks`): the same softmax rows, with scores held for
  one block only.

  Args:
    q: [B, T, H, dq].
    k: [B, T, Hkv, dq], Hkv dividing H (query head h reads kv head
      h // (H / Hkv)).
    v: [B, T, Hkv, dv].
    query_block: queries per block.
    chunk_size: C > 0 restricts each query to the keys of its own aligned
      chunk of C positions (Llama 4's chunked attention: row r sees the
      keys r - r % C .. r); 0 lets it see every earlier key.

  Returns:
    [B, T, H, dv] in v's dtype; scores and softmax in float32.
  """
  if chunk_size == 0 and tpu_flash_fits(q, k, v):
    return _tpu_flash_attention(q, k, v)
  return in_query_blocks(
      lambda q_rows, first_row: _attention_rows(
          q_rows, k, v, first_row, chunk_size
      ),
      q,
      query_block,
  )


# Set DROPLESS_TPU_FLASH_ATTENTION=0 to keep the XLA attention on a TPU.
_FLASH_ENV = "DROPLESS_TPU_FLASH_ATTENTION"
# Which Pallas kernel the TPU path runs: "splash" (JAX's splash attention:
# block-sparse, so the causal mask's upper blocks are neither computed nor
# fetched, one logsumexp residual [H, T] and one fused backward kernel) or
# "flash" (JAX's older flash attention kernel, whose residuals are
# broadcast to 128 lanes: 6.1 ms of a 147 ms tpu_v5e_dsv3 step on a v5e).
_KERNEL_ENV = "DROPLESS_TPU_ATTENTION_KERNEL"
ATTENTION_KERNELS = ("splash", "flash")
# The kernels' blocks along the sequence: the largest of these that
# divides it (512 x 512 float32 scores are 1 MiB of VMEM).
_FLASH_BLOCKS = (512, 256, 128)


def tpu_flash_fits(q: jax.Array, k: jax.Array, v: jax.Array) -> bool:
  """Whether `causal_attention` runs a Pallas TPU attention kernel: the
  default backend is a TPU with one device (the program runs there; an
  ahead-of-time compile for a TPU from another host keeps the XLA
  attention, and so does a mesh of several chips: XLA cannot partition the
  kernel's call, which would gather q, k and v onto every device),
  DROPLESS_TPU_FLASH_ATTENTION is not "0", and the shapes are the
  kernels': one head size for q, k and v, a multiple of 128, and a
  sequence a multiple of 128 (T == Tq, no chunks)."""
  if os.environ.get(_FLASH_ENV, "1") == "0":
    return False
  if jax.default_backend() != "tpu" or jax.device_count() != 1:
    return False
  t, d = q.shape[1], q.shape[-1]
  return (
      k.shape[1] == t
      and k.shape[-1] == d
      and v.shape[-1] == d
      and d % 128 == 0
      and t % 128 == 0
  )


def tpu_attention_kernel() -> str:
  """The kernel the TPU path runs: DROPLESS_TPU_ATTENTION_KERNEL, one of
  ATTENTION_KERNELS, "splash" when unset.

  Raises:
    ValueError: the variable names another kernel.
  """
  name = os.environ.get(_KERNEL_ENV, "splash")
  if name not in ATTENTION_KERNELS:
    raise ValueError(
        f"{_KERNEL_ENV} must be one of {ATTENTION_KERNELS}, got {name!r}."
    )
  return name


def _tpu_flash_attention(q, k, v) -> jax.Array:
  """`causal_attention` by a Pallas TPU kernel (`tpu_attention_kernel`):
  scores in VMEM blocks, never [B, H, T, T] in HBM; the backward is the
  kernel's own. Grouped kv heads are repeated to the query heads (their
  gradients sum back). q [B, T, H, d], k and v [B, T, Hkv, d]."""
  _, t, h, _ = q.shape
  group = h // k.shape[2]
  heads_first = lambda x: jnp.swapaxes(x, 1, 2)  # [B, H, T, d]
  kv = [heads_first(jnp.repeat(x, group, axis=2)) for x in (k, v)]
  block = next(n for n in _FLASH_BLOCKS if t % n == 0)
  attend = (
      _splash_kernel_call
      if tpu_attention_kernel() == "splash"
      else _flash_kernel_call
  )
  out = attend(heads_first(q), *kv, block)
  return heads_first(out).astype(v.dtype)


def _flash_kernel_call(q, k, v, block: int) -> jax.Array:
  """jax.experimental.pallas.ops.tpu.flash_attention, causal, on q, k, v
  [B, H, T, d] with square blocks of `block` rows: [B, H, T, d]."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu import flash_attention as flash

  blocks = flash.BlockSizes(
      block_q=block,
      block_k_major=block,
      block_k=block,
      block_b=1,
      block_q_major_dkv=block,
      block_k_major_dkv=block,
      block_k_dkv=block,
      block_q_dkv=block,
      block_k_major_dq=block,
      block_k_dq=block,
      block_q_dq=block,
  )
  return flash.flash_attention(
      q, k, v, causal=True, sm_scale=q.shape[-1] ** -0.5, block_sizes=blocks
  )


def _splash_kernel_call(q, k, v, block: int, interpret=False) -> jax.Array:
  """jax.experimental.pallas.ops.tpu.splash_attention, causal, on q, k, v
  [B, H, T, d] with square blocks of `block` rows and the fused dq/dkv
  backward (the layout MaxText runs on TPUs): [B, H, T, d].

  The kernel takes one sequence [H, T, d] and applies no scale: vmapped
  over the batch, q scaled by d ** -0.5 first (in float32, then rounded
  once to q's dtype).
  """
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu import splash_attention as splash

  _, h, t, d = q.shape
  sizes = splash.BlockSizes(
      block_q=block,
      block_kv=block,
      block_kv_compute=block,
      block_q_dkv=block,
      block_kv_dkv=block,
      block_kv_dkv_compute=block,
      use_fused_bwd_kernel=True,
  )
  mask = splash.MultiHeadMask([splash.CausalMask((t, t))] * h)
  kernel = splash.make_splash_mha_single_device(
      mask, block_sizes=sizes, interpret=interpret
  )
  scaled = (q.astype(jnp.float32) * d**-0.5).astype(q.dtype)
  return jax.vmap(kernel)(scaled, k, v)


def in_query_blocks(attend, q: jax.Array, query_block: int) -> jax.Array:
  """attend(q_rows, first_row) over the queries q [B, T, H, dq], by blocks.

  A sequence longer than `query_block` (and a multiple of it) runs one
  block of queries at a time (`jax.lax.map`), each rematerialised in the
  backward, so that only one block's scores are ever held; a shorter one
  (or one not a multiple) runs as one block, attend(q, 0).

  Args:
    attend: (q_rows [B, Tq, H, dq], first_row) -> [B, Tq, H, dv], the
      attention of the queries at rows first_row .. first_row + Tq - 1
      (first_row traced inside the loop).
    q: [B, T, H, dq].
    query_block: queries per block.

  Returns:
    [B, T, H, dv], the blocks' outputs in row order.
  """
  b, t, h, _ = q.shape
  if t <= query_block or t % query_block:
    return attend(q, 0)
  blocks = t // query_block
  q_blocks = jnp.moveaxis(q.reshape(b, blocks, query_block, *q.shape[2:]), 1, 0)

  @jax.checkpoint
  def one_block(args):
    q_rows, index = args
    return attend(q_rows, index * query_block)

  out = jax.lax.map(one_block, (q_blocks, jnp.arange(blocks)))
  return jnp.moveaxis(out, 0, 1).reshape(b, t, h, out.shape[-1])


def _attention_rows(q, k, v, first_row, chunk_size=0) -> jax.Array:
  """Attention of the queries at rows first_row.. of the sequence.

  Args:
    q: [B, Tq, H, dq], the queries of rows first_row .. first_row + Tq - 1.
    k, v: [B, T, Hkv, dq|dv], every key and value of the sequence.
    first_row: the first query's position (a traced int inside a loop).
    chunk_size: as `causal_attention`'s.
  """
  b, tq, h, dq = q.shape
  t, hkv = k.shape[1], k.shape[2]
  q = q.reshape(b, tq, hkv, h // hkv, dq)
  logits = (
      jnp.einsum("btkgd,bskd->bkgts", q, k, preferred_element_type=jnp.float32)
      * dq**-0.5
  )
  rows = first_row + jnp.arange(tq)[:, None]
  cols = jnp.arange(t)[None, :]
  causal = rows >= cols
  if chunk_size:
    causal &= rows // chunk_size == cols // chunk_size
  logits = jnp.where(causal, logits, jnp.finfo(jnp.float32).min)
  probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
  out = jnp.einsum(
      "bkgts,bskd->btkgd", probs, v, preferred_element_type=jnp.float32
  )
  return out.reshape(b, tq, h, v.shape[-1]).astype(v.dtype)
