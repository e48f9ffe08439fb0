"""Other systems' formats in and out.

  hf_config.py     the families that convert (llama, mistral, qwen2, qwen3, mixtral): config.json <-> model fields
  hf.py            Hugging Face checkpoints: tensor names and layouts, from_hf and to_hf
  weights.py       safetensors read and written one tensor at a time, a parameter tree saved without a second copy
  hf_tokenizer.py  tokenizer files: which travel, a run's tokenizer as the files AutoTokenizer reads
  diffusers_flux.py   diffusers' FluxTransformer2DModel <-> meshtrain's Flux (models/flux.py)
  diffusers_vae.py    diffusers' AutoencoderKL <-> meshtrain's VAE (models/vae.py)
  text_encoders.py    transformers' CLIPTextModel and T5EncoderModel <-> models/clip_text.py and models/t5.py
  flux_tokenizers.py  a Flux pipeline's CLIP and T5 tokenizers without transformers: prompts -> FluxPipeline's ids
"""
