"""`dsv41 generate --image` and images in `--messages`, end to end on a small checkpoint with a tiny
vision tower (official layout, byte-level tokenizer whose `<｜deepseek_image｜>` is the image token)."""

from __future__ import annotations

import json
import pytest
import torch

PIL = pytest.importorskip("PIL.Image")


class Result:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


@pytest.fixture
def run_cli(capsys):
    """`dsv41 ...` in this process (no interpreter start-up, no second torch import): exit code, stdout, stderr."""
    from dsv41_cli.app import main

    def run(*argv):
        capsys.readouterr()
        try:
            main(list(argv))
            code = 0
        except SystemExit as e:
            code = e.code or 0
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


@pytest.fixture(scope="module")
def vision_checkpoint(tmp_path_factory):
    from checkpoints import small_tokenizer

    from dsv41.model import encoding
    from dsv41.model.config import preset
    from dsv41.model.engram import build_compressed_token_map
    from dsv41.model.fixtures import write_official_fixture
    from dsv41.model.tokenizer import Tokenizer as DsTokenizer

    dst = tmp_path_factory.mktemp("vision_ckpt") / "ckpt"
    tok = small_tokenizer()
    wrapped = DsTokenizer(tok, source="small", bos_token=encoding.BOS, eos_token=encoding.EOS)
    _, n_compressed = build_compressed_token_map(wrapped, cache_dir=False)
    pad = tok.token_to_id("<｜▁pad▁｜>")
    args = preset("tiny").replace(
        engram_compressed_vocab_size=n_compressed, engram_pad_id=pad, pad_token_id=pad,
        bos_token_id=tok.token_to_id(encoding.BOS), eos_token_id=tok.token_to_id(encoding.EOS),
        dspark_noise_token_id=pad, image_token_id=tok.token_to_id(encoding.IMAGE_PLACEHOLDER),
        vision_n_layers=2, vision_dim=32, vision_n_heads=2, vision_inter_dim=32, vision_min_pixels=28 * 28,
        vision_max_n_token=40)
    write_official_fixture(dst, args, seed=0, n_shards=3, tokenizer=False)
    tok.save(str(dst / "tokenizer.json"))
    (dst / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": encoding.BOS, "eos_token": encoding.EOS, "add_bos_token": False, "add_eos_token": False}))
    image = dst.parent / "circle.png"
    canvas = PIL.new("RGB", (70, 70), (255, 255, 255))
    from PIL import ImageDraw

    ImageDraw.Draw(canvas).ellipse((10, 10, 60, 60), fill=(220, 20, 20))
    canvas.save(image)
    return dst, image


def test_print_prompt_puts_the_images_before_the_text(tmp_path, run_cli):
    from dsv41.model.encoding import IMAGE_PLACEHOLDER

    image = tmp_path / "a.png"
    PIL.new("RGB", (8, 8)).save(image)
    r = run_cli("generate", "What is this?", "--image", str(image), "--image", str(image), "--mode", "chat",
                "--print-prompt")
    assert r.returncode == 0, r.stderr
    # content blocks are joined by blank lines, as the official encoder renders them
    image_part = f"{IMAGE_PLACEHOLDER}\n\n"
    assert r.stdout == f"<｜begin▁of▁sentence｜><｜User｜>{image_part * 2}What is this?<｜Assistant｜></think>"
    # an <image>path</image> tag in the prompt renders the same way
    tagged = run_cli("generate", f"<image>{image}</image>What is this?", "--image", str(image), "--mode", "chat",
                     "--print-prompt")
    assert tagged.stdout == r.stdout
    r = run_cli("generate", "What is this?", "--image", str(tmp_path / "missing.png"), "--print-prompt")
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "missing.png" in r.stderr


def test_generate_with_an_image_matches_the_library(vision_checkpoint, tmp_path, run_cli):
    from dsv41.model.checkpoint import load_model
    from dsv41.model.encoding import encode_messages_with_images
    from dsv41.model.engine import GenerationConfig, Generator
    from dsv41.model.vision import expand_image_placeholders

    ckpt, image = vision_checkpoint
    common = ["--model", str(ckpt), "--max-new-tokens", "6", "--temperature", "0", "--json", "--mode", "chat"]
    r = run_cli("generate", "What is in the image?", "--image", str(image), *common)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)

    model, args, tok = load_model(ckpt)
    msgs = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": str(image)}},
                                         {"type": "text", "text": "What is in the image?"}]}]
    prompt, records = encode_messages_with_images(msgs, mode="chat")
    ids, types, inputs = expand_image_placeholders(tok.encode(prompt), records, args)
    # 70x70 -> 5x5 patches -> 2x2 tokens -> 2*3+2 = 8 positions in place of the one placeholder
    assert len(ids) == len(tok.encode(prompt)) + 7 == doc["prompt_tokens"]
    want = Generator(model, tok).generate(ids, GenerationConfig(max_new_tokens=6, stop_ids=(tok.eos_id,)),
                                          images=inputs)
    assert doc["output_ids"] == want.output_ids

    # the same message through --messages, and through an <image>path</image> tag
    (tmp_path / "m.json").write_text(json.dumps(msgs))
    r2 = run_cli("generate", "--messages", str(tmp_path / "m.json"), *common)
    assert r2.returncode == 0, r2.stderr
    assert json.loads(r2.stdout)["output_ids"] == doc["output_ids"]

    # the image matters: a different image gives a different prompt embedding (other logits)
    with torch.inference_mode():
        other = tmp_path / "blue.png"
        PIL.new("RGB", (70, 70), (0, 0, 255)).save(other)
        _, _, inputs2 = expand_image_placeholders(tok.encode(prompt), [{"url": str(other)}], args)
        a = model(torch.tensor([ids]), images=[inputs])
        b = model(torch.tensor([ids]), images=[inputs2])
    assert not torch.equal(a, b)


def test_images_for_a_model_without_vision_exit_2(small_checkpoint, tmp_path, run_cli):
    image = tmp_path / "a.png"
    PIL.new("RGB", (8, 8)).save(image)
    r = run_cli("generate", "Hi", "--image", str(image), "--model", str(small_checkpoint), "--max-new-tokens", "2")
    assert r.returncode == 2 and "no vision tower" in r.stderr and len(r.stderr.strip().splitlines()) == 1
