"""Running trained models: text generation and DiT sampling, the library behind `generate` and `sample`.

  generator.py    Generator (compiled prefill + KV-cache decode), Sampling, Output, and the backend's choice of how
                  the model runs while decoding (meshtrain/kernels on the CPU)
  engine.py       continuous batching for serving: decode slots, prefill and insert, one decode step for all slots
  server.py       the OpenAI-compatible HTTP server over the engine (Starlette, uvicorn, prometheus-client)
  stream.py       completions printed as they arrive, on process 0 only (the generate command's output)
  dit_sampler.py  a DiT's compiled sampler, its labelled grid and raw samples, the training-time SampleHook
  quality.py      the digits judge: sample accuracy and Frechet distance of class-conditional samples
  flux_pipeline.py  a diffusers Flux.1 pipeline directory run by meshtrain's components: prompts -> pictures
"""
