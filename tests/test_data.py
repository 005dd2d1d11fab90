"""data.py: schema errors name file/line/sample/field, sandboxed prompts, placeholder checks.

    .venv/bin/python -m pytest -q tests/test_data.py
"""
import json

import pytest
from conftest import tiny_config
from jinja2.exceptions import SecurityError

import data

GOOD = {"id": "s1", "problem": "What color?", "answer": "A", "problem_type": "multiple choice",
        "options": ["A. red", "B. green", "C. blue", "D. yellow"], "videos": ["v.mp4"], "data_type": "video"}


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize("bad, field", [
    ({k: v for k, v in GOOD.items() if k != "answer"}, "'answer'"),
    ({k: v for k, v in GOOD.items() if k != "problem"}, "'problem'"),
    (dict(GOOD, problem=3), "'problem'"),
    (dict(GOOD, videos="v.mp4"), "'videos'"),
    (dict(GOOD, videos=[""]), "'videos'"),
    (dict(GOOD, options="A. red"), "'options'"),
    (dict(GOOD, data_type="audio"), "'data_type'"),
    (dict(GOOD, data_type="image"), "'data_type'"),
    (dict(GOOD, answer="Z"), "'answer'"),
    (dict(GOOD, problem_type="temporal grounding", answer="sometime"), "'answer'"),
])
def test_schema_errors_name_file_line_sample_field(tmp_path, bad, field):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, bad])
    with pytest.raises(data.DataError) as e:
        data.load_samples(path)
    msg = str(e.value)
    assert f"{path}:2" in msg and field in msg, msg
    assert "sample" in msg


def test_malformed_json_line_and_skip_mode(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, '{"problem": "x",', dict(GOOD, id="s3")])
    with pytest.raises(data.DataError, match=r"d.jsonl:2: malformed JSON"):
        data.load_samples(path)
    skipped = []
    ok = data.load_samples(path, skip_invalid=True, skipped=skipped)
    assert [s["id"] for s in ok] == ["s1", "s3"]
    assert len(skipped) == 1 and skipped[0]["where"].endswith("d.jsonl:2")


def test_paths_resolve_relative_to_the_file(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD])
    (s,) = data.load_samples(path)
    assert s["videos"] == [str(tmp_path / "v.mp4")]


def test_prompt_templates_are_sandboxed():
    text = data.render_prompt(GOOD)
    assert "Options:\nA. red\nB. green" in text and "<answer>" in text
    with pytest.raises(SecurityError):
        data.render_prompt(GOOD, template="{{ problem.__class__.__mro__[1].__subclasses__() }}")


def test_media_markers_place_the_video():
    msgs = data.chat_messages(dict(GOOD, problem="Watch <video> then answer."), "Watch <video> then answer.")
    kinds = [c["type"] for c in msgs[0]["content"]]
    assert kinds == ["text", "video", "text"]
    assert [c["type"] for c in data.chat_messages(GOOD, "q")[0]["content"]] == ["video", "text"]


def test_prepare_video_and_image_and_placeholder_check(tiny_model, synth):
    from transformers import AutoProcessor
    proc = AutoProcessor.from_pretrained(tiny_model)
    cfg = tiny_config()
    samples = data.load_samples(f"{synth}/train.jsonl")
    vid = next(s for s in samples if s.get("videos"))
    img = next(s for s in samples if s.get("images"))
    stats = {"cache_hit": 0, "cache_miss": 0, "decode": 0, "decode_s": 0.0}
    p = data.prepare(vid, proc, cfg, stats)
    frames, meta = p.videos[0]
    assert frames.shape[1:] == (56, 56, 3) and frames.shape[0] % 2 == 0
    n_pad = p.prompt_ids.count(proc.tokenizer.convert_tokens_to_ids("<|video_pad|>"))
    assert n_pad == int(p.mm["video_grid_thw"].prod()) // 4 > 0
    assert stats["decode"] == 1
    q = data.prepare(img, proc, cfg)
    image_pad = proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert q.prompt_ids.count(image_pad) == int(q.mm["image_grid_thw"].prod()) // 4
    # a prompt whose placeholders do not match the features is caught, naming the sample
    with pytest.raises(data.DataError, match=f"sample {vid['id']}: video placeholder tokens"):
        video_pad = proc.tokenizer.convert_tokens_to_ids("<|video_pad|>")
        data.check_placeholders(p.prompt_ids[:-3] + [video_pad] * 3 + p.prompt_ids[-3:], p.mm, proc, vid["id"])
    with pytest.raises(data.DataError, match="max_prompt_len"):
        data.prepare(vid, proc, tiny_config(max_prompt_len=10))


def test_json_array_items_are_numbered_like_lines(tmp_path):
    """A .json array names its items 1-based, as a .jsonl names its lines: the second item is ':2'."""
    path = tmp_path / "d.json"
    path.write_text(json.dumps([GOOD, {k: v for k, v in GOOD.items() if k != "answer"}]))
    with pytest.raises(data.DataError, match=rf"{path}:2: sample .*'answer'"):
        data.load_samples(str(path))
