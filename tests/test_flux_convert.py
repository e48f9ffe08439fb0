"""`python -m meshtrain.convert from-diffusers` / `to-diffusers` and `python -m meshtrain.sample` on a Flux.1 workdir
(meshtrain/interop/diffusers_pipeline.py), on a tiny random pipeline of every component saved by diffusers' own
FluxPipeline.save_pretrained (tests/test_flux_pipeline.py builds it): the workdir samples what FluxPipeline draws
from the same latents, exports back to a directory FluxPipeline loads with every tensor and file as it was, and
the server answers prompts with the pictures `sample` draws, and every input it cannot take is one `error:` line,
exit 2, nothing written."""
import base64
import filecmp
import io
import json
import subprocess
import sys

import ml_collections
import numpy as np
import openai
import pytest
import torch
from diffusers import FluxPipeline
from PIL import Image
from test_flux_pipeline import HEIGHT, PROMPTS, WIDTH, build
from test_serve import start_server

from meshtrain.cli import convert
from meshtrain.errors import UserError
from meshtrain.interop import diffusers_pipeline

CONVERT = ["--image-size", str(HEIGHT), "--max-sequence-length", "16"]


@pytest.fixture(scope="module")
def dev(tmp_path_factory):
  root = tmp_path_factory.mktemp("flux_convert")
  pipe, path = build(root, guidance=True)
  workdir = root / "run"
  assert convert.main(["from-diffusers", str(path), "--workdir", str(workdir), *CONVERT]) == 0
  return pipe, path, workdir


def run_sample(*args):
  return subprocess.run([sys.executable, "-m", "meshtrain.sample", *map(str, args)], capture_output=True, text=True,
                        timeout=600)


def test_the_workdir_samples_what_flux_pipeline_draws(dev, tmp_path):
  pipe, _, workdir = dev
  cfg = json.loads((workdir / "config.json").read_text())
  assert cfg["task"] == "t2i" and cfg["model"]["pipeline"] == str(workdir / "pipeline")
  assert (cfg["model"]["image_size"], cfg["model"]["channels"], cfg["model"]["text_len"]) == (HEIGHT // 8, 4, 16)
  assert (cfg["sample"]["steps"], cfg["sample"]["guidance"]) == (28, 3.5)  # FluxPipeline's defaults for dev
  latents = torch.randn(len(PROMPTS), (HEIGHT // 16) * (WIDTH // 16), 16, generator=torch.Generator().manual_seed(3))
  np.save(tmp_path / "latents.npy", latents.numpy())
  with torch.no_grad():
    theirs = pipe(prompt=PROMPTS, height=HEIGHT, width=WIDTH, num_inference_steps=3, guidance_scale=2.5,
                  max_sequence_length=16, latents=latents.clone(), output_type="np").images
  done = run_sample("--workdir", workdir, *sum([["--prompt", p] for p in PROMPTS], []), "--n", 1, "--size",
                    f"{WIDTH}x{HEIGHT}", "--steps", 3, "--guidance", 2.5, "--latents", tmp_path / "latents.npy",
                    "--out", tmp_path / "grid.png", "--out-npy", tmp_path / "pictures.npy")
  assert done.returncode == 0, done.stderr
  assert "step 0: 2 pictures" in done.stdout
  ours = np.load(tmp_path / "pictures.npy")
  assert ours.shape == theirs.shape and ours.dtype == np.float32
  assert np.abs(ours - theirs).max() < 1e-4  # as tests/test_flux_pipeline.py: measured ~2e-6


def test_the_server_answers_with_the_pictures_sample_draws(dev, tmp_path):
  _, _, workdir = dev
  done = run_sample("--workdir", workdir, "--prompt", PROMPTS[0], "--n", 2, "--steps", 3, "--guidance", 2.5,
                    "--seed", 5, "--out", tmp_path / "g.png", "--npy", tmp_path / "g.npz")
  assert done.returncode == 0, done.stderr
  pictures = np.round(np.load(tmp_path / "g.npz")["images"] * 255).astype(np.uint8)
  assert pictures.shape == (2, HEIGHT, HEIGHT, 3)  # the run's size: --image-size of the conversion
  proc, url = start_server(workdir, "--lazy")
  try:
    client = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=300)
    served = client.images.generate(model=None, prompt=PROMPTS[0], n=2, response_format="b64_json",
                                    extra_body={"seed": 5, "steps": 3, "guidance": 2.5})
    np.testing.assert_array_equal(
        np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(d.b64_json)))) for d in served.data]), pictures)
  finally:
    proc.kill()


def test_to_diffusers_gives_back_what_it_was_given(dev, tmp_path):
  pipe, path, workdir = dev
  out = tmp_path / "exported"
  assert convert.main(["to-diffusers", "--workdir", str(workdir), "--out", str(out)]) == 0
  for part in diffusers_pipeline.FROZEN:
    compared = filecmp.dircmp(path / part, out / part)
    assert not (compared.left_only or compared.right_only or compared.diff_files), part
  back = FluxPipeline.from_pretrained(out)
  original = pipe.transformer.state_dict()
  for name, w in back.transformer.state_dict().items():
    assert torch.equal(w, original[name]), name
  assert back.transformer.state_dict().keys() == original.keys()


def test_a_lone_transformer_converts_with_its_pipeline(dev, tmp_path):
  _, path, _ = dev
  assert convert.main(["from-diffusers", str(path / "transformer"), "--workdir", str(tmp_path / "w"),
                       "--pipeline", str(path), *CONVERT]) == 0
  assert (tmp_path / "w" / "pipeline" / "text_encoder_2").is_dir()


def test_training_it_is_refused_for_now(dev):
  from meshtrain.data import images
  _, _, workdir = dev
  cfg = ml_collections.ConfigDict(json.loads((workdir / "config.json").read_text()))
  with pytest.raises(UserError, match="not built yet"):
    images.make_captioned_source(cfg, "train", shuffle=True)


def refused(capsys, argv, message, *untouched):
  assert convert.main([str(a) for a in argv]) == 2
  err = capsys.readouterr().err
  assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and message in err, err
  for path in untouched:
    assert not path.exists()


def test_bad_input_is_one_clear_error_and_nothing_is_written(dev, tmp_path, capsys):
  _, path, workdir = dev
  out = tmp_path / "out"
  refused(capsys, ["from-diffusers", tmp_path / "missing", "--workdir", out], "is not a directory", out)
  refused(capsys, ["from-diffusers", path / "transformer", "--workdir", out], "give --pipeline DIR", out)
  refused(capsys, ["from-diffusers", path / "vae", "--workdir", out], "'AutoencoderKL'", out)
  refused(capsys, ["from-diffusers", path, "--workdir", out, "--image-size", "40"], "multiple of 16", out)
  refused(capsys, ["from-diffusers", path, "--workdir", workdir], "not empty")
  other = tmp_path / "other"
  other.mkdir()
  for part in diffusers_pipeline.COMPONENTS:
    (other / part).symlink_to(path / part)
  index = json.loads((path / "model_index.json").read_text())
  (other / "model_index.json").write_text(json.dumps({**index, "_class_name": "FluxKontextPipeline"}))
  refused(capsys, ["from-diffusers", other, "--workdir", out], "not a FluxPipeline", out)
  refused(capsys, ["to-diffusers", "--workdir", tmp_path, "--out", out], "holds no checkpoints", out)
  done = run_sample("--workdir", workdir, "--prompt", "a cat", "--size", "40x32", "--out", tmp_path / "g.png")
  assert done.returncode == 2 and "multiples of 16" in done.stderr, done.stderr
