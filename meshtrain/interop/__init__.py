"""Other systems' formats in and out.

  hf.py            Hugging Face Llama checkpoints: config mapping, tensor names and layouts, from_hf and to_hf
  weights.py       safetensors read and written one tensor at a time, a parameter tree saved without a second copy
  hf_tokenizer.py  tokenizer files: which travel, a run's tokenizer as the files AutoTokenizer reads
"""
