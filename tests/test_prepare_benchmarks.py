"""scripts/prepare_benchmarks.py on small fixtures typed in the releases' shapes (tests/fixtures/releases/)."""

import json
import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import prepare_benchmarks as P  # noqa: E402

import evaluate as E  # noqa: E402

RELEASES = os.path.join(ROOT, "tests", "fixtures", "releases")


def test_egoschema_join_loads_and_counts_hidden_answers(tmp_path):
    counts = P.main(
        P.Config(benchmark="egoschema", src=os.path.join(RELEASES, "egoschema"), out=str(tmp_path))
    )
    assert counts == {"questions": 2, "with answer": 1}
    skipped = []
    (s,) = E.load_benchmark("egoschema", E.Config(data_dir=str(tmp_path), video_dir="/v"), skipped)
    want = ("ego0", "D", "D. yellow", "/v/egoschema/ego0.mp4")  # answer 3: the 4th option
    assert (s["id"], s["answer"], s["options"][3], s["videos"][0]) == want
    assert [x["error"] for x in skipped] == ["no ground truth"]  # ego1: graded by the server only
    # the committed fixture is this script's output
    with (
        open(os.path.join(ROOT, "tests", "fixtures", "benchmarks", "egoschema.json")) as a,
        open(tmp_path / "egoschema.json") as b,
    ):
        assert json.load(a) == json.load(b)


def test_egoschema_bad_inputs_are_named(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(os.path.join(RELEASES, "egoschema"), src)
    (src / "subset_answers.json").write_text(json.dumps({"ego0": 3, "nope": 1}))
    with pytest.raises(
        ValueError, match=r"subset_answers.json: 1 q_uid not in questions.json, first nope"
    ):
        P.egoschema(str(src), str(tmp_path / "out"))
    (src / "subset_answers.json").write_text(json.dumps({"ego0": 7}))
    with pytest.raises(ValueError, match=r"ego0: answer 7 is not an option index 0..4"):
        P.egoschema(str(src), str(tmp_path / "out"))
    os.remove(src / "subset_answers.json")
    with pytest.raises(FileNotFoundError, match=r"subset_answers.json: not found"):
        P.egoschema(str(src), str(tmp_path / "out"))


def test_nextqa_videos_are_linked_flat(tmp_path):
    src = tmp_path / "NExTVideo"
    shutil.copytree(os.path.join(RELEASES, "nextqa", "NExTVideo"), src)
    (src / "0000" / "4010069381.mp4").write_bytes(b"video")
    (src / "map_vid_vidorID.json").write_text(
        json.dumps({"4010069381": "0000/4010069381", "99": "0001/99"})
    )
    assert P.nextqa(str(src), str(tmp_path / "videos")) == {"videos linked": 1, "videos missing": 1}
    assert (tmp_path / "videos" / "nextqa" / "4010069381.mp4").read_bytes() == b"video"
    assert not (tmp_path / "videos" / "nextqa" / "4010069381.mp4").is_symlink()  # inside the folder
    assert (
        P.nextqa(str(src), str(tmp_path / "videos"))["videos linked"] == 1
    )  # again: the link is replaced
