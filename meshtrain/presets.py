"""Model shapes, from CI-sized to LLaMA-3-8B and Mixtral-8x7B. A preset is a starting point: any field can change.

The large presets are for GPUs and for compile-only inspection on CPU; their vocabularies are those of real
tokenizers (the byte-level corpus uses 259 ids of them).
"""
import ml_collections

_SHAPES = {
    # name:      layers, d_model, heads, kv_heads, head_dim, mlp_dim, vocab,  tied,  rope_theta
    "tiny":     (4,      128,     8,     4,        16,       512,     384,    False, 10_000.0),
    "125m":     (12,     768,     12,    12,       64,       2048,    50_304, True,  10_000.0),
    "1b":       (16,     2048,    32,    8,        64,       8192,    128_256, True, 500_000.0),
    "8b":       (32,     4096,    32,    8,        128,      14_336,  128_256, False, 500_000.0),
}
# Today's open models, as their Hugging Face config.json files describe them (python -m meshtrain.convert from-hf
# of the published checkpoint gives these fields): the shape as above, then what differs from the defaults below.
_OPEN_MODELS = {
    "llama-3.2-1b": ((16, 2048, 32, 8, 64, 8192, 128_256, True, 500_000.0),
                     dict(rope_type="llama3", rope_factor=32.0, rope_original_max_len=8192, hf_model_type="llama")),
    "llama-3.1-8b": ((32, 4096, 32, 8, 128, 14_336, 128_256, False, 500_000.0),
                     dict(rope_type="llama3", rope_factor=8.0, rope_original_max_len=8192, hf_model_type="llama")),
    "qwen2.5-0.5b": ((24, 896, 14, 2, 64, 4864, 151_936, True, 1_000_000.0),
                     dict(attention_bias=True, norm_eps=1e-6, hf_model_type="qwen2")),
    "qwen3-0.6b": ((28, 1024, 16, 8, 128, 3072, 151_936, True, 1_000_000.0),
                   dict(qk_norm=True, norm_eps=1e-6, hf_model_type="qwen3")),
    "mixtral-8x7b": ((32, 4096, 32, 8, 128, 14_336, 32_000, False, 1_000_000.0),
                     dict(num_experts=8, experts_per_token=2, aux_loss_weight=0.02, hf_model_type="mixtral")),
}
PRESETS = tuple(_SHAPES) + tuple(_OPEN_MODELS)


def model_config(name: str) -> ml_collections.ConfigDict:
  """The `model` config group for preset `name`; every field is documented here."""
  if name in _OPEN_MODELS:
    shape, fields = _OPEN_MODELS[name]
    m = _model_config(name, *shape)
    m.update(fields)
    return m
  return _model_config(name, *_SHAPES[name])


def _model_config(name, layers, d_model, heads, kv_heads, head_dim, mlp_dim, vocab, tied, theta):
  m = ml_collections.ConfigDict()
  m.preset = name                 # informational: which preset these numbers came from
  m.num_layers = layers           # decoder blocks
  m.d_model = d_model             # residual stream width (D)
  m.num_heads = heads             # query heads (H)
  m.num_kv_heads = kv_heads       # key/value heads (K); H/K query heads share each (grouped-query attention)
  m.head_dim = head_dim           # per-head width (E)
  m.mlp_dim = mlp_dim             # SwiGLU hidden width (F)
  m.vocab_size = vocab            # embedding rows / logits (V)
  m.tie_embeddings = tied         # reuse the embedding matrix as the output projection
  m.rope_theta = theta            # rotary embedding base
  m.rope_type = "default"         # rotary scaling: default | linear | llama3 | yarn (meshtrain/models/rope.py)
  m.rope_factor = 1.0             # context extension factor (linear, llama3, yarn)
  m.rope_original_max_len = 0     # context the model was pretrained on (llama3, yarn)
  m.rope_low_freq_factor = 1.0    # llama3: wavelengths above original_max_len / this are divided by rope_factor
  m.rope_high_freq_factor = 4.0   # llama3: wavelengths below original_max_len / this are kept
  m.rope_beta_fast = 32.0         # yarn: rotations where the ramp to the original frequencies ends
  m.rope_beta_slow = 1.0          # yarn: rotations where the ramp from the interpolated frequencies starts
  m.rope_attention_factor = 0.0   # yarn: cos/sin multiplied by this; 0 = 0.1 ln(rope_factor) + 1
  m.attention_bias = False        # biases on the q, k, v projections (Qwen2); o never has one
  m.qk_norm = False               # RMSNorm over each query and key head before rotary (Qwen3)
  m.sliding_window = 0            # > 0: each token attends to the last this-many tokens, itself included (Mistral)
  m.hf_model_type = ""            # the Hugging Face model_type convert to-hf writes (llama | mistral | qwen2 |
                                  # qwen3 | mixtral); "": the simplest that holds this model's features
  m.norm_eps = 1e-5               # RMSNorm epsilon
  m.init = "normal"               # normal: normal(init_std) | fan_in: MaxText's initialisers (see models/llama.py)
  m.init_std = 0.02               # init=normal: stddev of every matrix (output projections scaled by depth)
  m.dtype = "float32"             # compute dtype: float32 | bfloat16 (parameters stay in param_dtype)
  m.param_dtype = "float32"       # storage dtype of parameters and optimizer state
  m.remat = "none"                # rematerialization: none | full | save_dots (keep matmul outputs, recompute the rest)
  m.scan_layers = True            # run the blocks under jax.lax.scan (one compiled block) instead of unrolled
  m.scan_unroll = 0               # layers per scan iteration: 0 = auto (all, for <= 4 layers, no remat, no sequence
                                  # split; else 1) | n
  m.attention = "auto"            # auto | blocked | xla | cudnn (meshtrain/models/attention.py)
  m.context_attention = "ring"    # with mesh.sequence > 1: ring (K/V passed around, O(L/n) memory) | allgather
  m.num_experts = 0               # > 0: mixture-of-experts MLPs with this many experts (each of width mlp_dim)
  m.experts_per_token = 2         # experts each token is routed to (top-k)
  m.capacity_factor = 1.25        # expert slots per group = ceil(factor x tokens x k / experts); overflow is dropped
  m.aux_loss_weight = 1e-2        # Switch load-balancing loss weight
  m.router_z_loss_weight = 1e-3   # router z-loss weight (keeps router logits small)
  return m


_DIT_SHAPES = {
    # name:     image_size, channels, patch_size, classes, layers, d_model, heads, mlp_dim
    "digits":  (8,          1,        2,          10,      4,      128,     4,     512),
}
DIT_PRESETS = tuple(_DIT_SHAPES)


def dit_model_config(name: str) -> ml_collections.ConfigDict:
  """The `model` config group of a diffusion transformer (task=dit, meshtrain/models/dit.py) for preset `name`."""
  image_size, channels, patch_size, classes, layers, d_model, heads, mlp_dim = _DIT_SHAPES[name]
  m = ml_collections.ConfigDict()
  m.preset = name                 # informational: which preset these numbers came from
  m.image_size = image_size       # square images of image_size x image_size pixels (H = W)
  m.channels = channels           # C: 1 grayscale, 3 RGB
  m.patch_size = patch_size       # P: each P x P patch is one token; (image_size / P)^2 tokens (T)
  m.num_classes = classes         # class ids 0..num_classes-1; id num_classes is the null class (guidance)
  m.num_layers = layers           # adaLN-Zero blocks
  m.d_model = d_model             # token width (D); divisible by 4 (2-D sin-cos positions) and by num_heads
  m.num_heads = heads             # attention heads (A), each d_model / num_heads wide
  m.mlp_dim = mlp_dim             # GELU MLP hidden width (F)
  m.class_dropout = 0.1           # training labels replaced by the null class with this probability (for guidance)
  m.init_std = 0.02               # stddev of every weight the adaLN-Zero scheme does not zero
  m.dtype = "float32"             # compute dtype: float32 | bfloat16 (parameters stay in param_dtype)
  m.param_dtype = "float32"       # storage dtype of parameters and optimizer state
  m.remat = "none"                # rematerialization: none | full (recompute each block in the backward pass)
  return m


_T2I_SHAPES = {
    # name:  image_size, patch, d_model, heads, mlp_dim, double, single, axes_dim,     text: len, width, layers, heads
    "tiny": (32,         4,     128,     4,     512,     2,      2,      (8, 12, 12),  32,        128,   2,      4),
    # 1.27B parameters at 256 px in pixel space, patch 8 (1,024 image tokens): Flux's head width and RoPE
    # split (128 = 16 + 56 + 56), a quarter of its depth; the latent version waits for the VAE.
    "1b": (256,         8,     1536,    12,    6144,    8,      16,     (16, 56, 56), 128,       512,   4,      8),
}
T2I_PRESETS = tuple(_T2I_SHAPES)


def t2i_model_config(name: str) -> ml_collections.ConfigDict:
  """The `model` group of a text-to-image transformer (task=t2i, meshtrain/models/flux.py) for preset `name`."""
  (image_size, patch, d_model, heads, mlp_dim, double, single, axes_dim, text_len, text_width, text_layers,
   text_heads) = _T2I_SHAPES[name]
  m = ml_collections.ConfigDict()
  m.preset = name                 # informational: which preset these numbers came from
  m.image_size = image_size       # square RGB images of image_size x image_size pixels
  m.channels = 3
  m.patch_size = patch            # each P x P patch is one image token: (image_size / P)^2 of them
  m.d_model = d_model             # token width (D), divisible by num_heads
  m.num_heads = heads
  m.mlp_dim = mlp_dim             # GELU MLP hidden width (Flux: 4 x d_model)
  m.double_layers = double        # double-stream (MMDiT) blocks: image and text weights apart, joint attention
  m.single_layers = single        # single-stream blocks on the joint sequence
  m.axes_dim = axes_dim           # RoPE features per position coordinate (0, row, column); sum = d_model / num_heads
  m.text_len = text_len           # caption bytes read (UTF-8; longer captions are cut)
  m.text_width = text_width       # the jointly trained text encoder: width, layers, heads, MLP width
  m.text_layers = text_layers
  m.text_heads = text_heads
  m.text_mlp_dim = 4 * text_width
  m.text_encoder = "own"          # own: the byte-level encoder above, trained with the model | PATH: a language-model
                                  # workdir (or PATH/checkpoints/N), frozen: its hidden states, cached beside the data
                                  # (meshtrain/data/text_features.py); text_len counts its tokens, text_width = its
                                  # d_model
  m.text_encoder_layer = -2       # the frozen encoder's hidden_states[k] (Hugging Face's numbering: 0 embeddings, -1
                                  # the last through the final norm, -2 the last block's input, as Z-Image takes it)
  m.pipeline = ""                 # a Flux.1 pipeline directory (python -m meshtrain.convert from-diffusers copies one
                                  # into WORKDIR/pipeline) whose VAE, text encoders, tokenizers and scheduler the model
                                  # uses: image_size and channels are then its latents', text_encoder "pipeline"
  m.text_norm = True              # how frozen features enter (a converted Flux.1 sets the next four; see flux.py):
  m.text_mask = True              # RMS-normalised, padding masked as keys, the pooled vector their mean (0) or one of
  m.pooled_width = 0              # this width given with them (CLIP's), a distilled guidance embedding (Flux.1-dev)
  m.guidance_embed = False
  m.caption_dropout = 0.1         # training captions replaced by the empty one with this probability (for guidance)
  m.shift = 0.0                   # time shift of training and sampling; 0: by resolution, Flux's rule (see t2i.py)
  m.init_std = 0.02
  m.dtype = "float32"             # compute dtype: float32 | bfloat16
  m.param_dtype = "float32"
  m.remat = "none"                # none | full
  m.scan_unroll = 0               # blocks per loop iteration of each stack: 0 = auto (a stack of at most 4 blocks
                                  # without remat is unrolled: no loop) | n
  return m
