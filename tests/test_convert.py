"""scripts/convert_data.py on sample records written in the exact field names and types of the two releases
(tests/fixtures/convert/): Video-R1-260k.json (a JSON array) and an EasyVideoR1 training JSONL. The media they
name are created as real files (H.264 videos, JPEG/PNG images) in a tmp folder; the CLI runs as a user runs it (a
subprocess for Video-R1; for EasyVideoR1 its argument parser in this process, which saves a second torch import),
and the converted records are checked field by field against hand-written expectations, then loaded with
data.load_samples and one video is decoded through the path the converted record gives."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import tyro
from PIL import Image

import cache
import convert_data
import data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(ROOT, "tests/fixtures/convert")
VR1_VIDEOS = [
    "LLaVA-Video-178K/liwei_youtube_videos/videos/youtube_video_2024/ytb_7nRmsEw7nsE.mp4",
    "STAR/Charades_v1_480/6H78U.mp4",
    "SR-91k/scannet/scene0000_00.mp4",
    "CLEVRER/video_10000-11000/video_10001.mp4",
]  # NeXT-QA/videos/not_downloaded.mp4 stays missing
VR1_IMAGES = [
    "Knowledge/ArxivQA/images/2101.00001_fig1.jpg",
    "Math/Multimath-300k/17ff4c7d14c388134de02381b1fc2824.png",
    "OCR/TextVQA/images/0a1b2c.jpg",
]


def make_media(root: str, videos: list[str], images: list[str]):
    from make_synthetic_data import write_video

    for rel in videos:
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        write_video(os.path.join(root, rel), np.full((4, 32, 32, 3), 120, np.uint8), fps=2.0)
    for rel in images:
        os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
        Image.fromarray(np.full((28, 28, 3), 200, np.uint8)).save(os.path.join(root, rel))


def run_cli(*args):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts/convert_data.py"), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.fixture
def video_r1(tmp_path):
    """The release's layout: Video-R1-data/ holds Video-R1-260k.json and the media its `path`s name."""
    root = tmp_path / "Video-R1-data"
    make_media(str(root), VR1_VIDEOS, VR1_IMAGES)
    shutil.copy(os.path.join(FIXTURES, "Video-R1-260k.json"), root)
    return root


def test_video_r1(video_r1, tmp_path):
    out = (
        tmp_path / "data" / "train.jsonl"
    )  # another folder than the media: paths must be rewritten relative to it
    stdout = run_cli(
        "--source",
        "video-r1",
        "--src",
        str(video_r1 / "Video-R1-260k.json"),
        "--out",
        str(out),
        "--offline-output",
    )  # no --media-root: the JSON's folder, as Video-R1 reads it
    assert "converted 7 | skipped 3" in stdout
    media = "../Video-R1-data/"
    expected = [
        {
            "id": "video-r1-0",
            "problem": "What appears on the screen in Russian during the missile's ascent?",
            "answer": "B",
            "problem_type": "multiple choice",
            "data_type": "video",
            "options": [
                "A. A weather map",
                "B. A countdown timer",
                "C. A news ticker",
                "D. A flag",
            ],
            "videos": [media + VR1_VIDEOS[0]],
            "offline_output": (
                "<think>Let me think. The overlay shows numbers counting down.</think>\n"
                "<answer>B</answer>"
            ),
            "problem_id": 1,
            "data_source": "LLaVA-Video-178K/2_3_m_youtube_v0_1",
        },
        {
            "id": "video-r1-1",
            "problem": "Which shape has the largest area?",
            "answer": "A",
            "problem_type": "multiple choice",
            "data_type": "image",
            "options": ["A) the circle", "B) the square", "C) the triangle"],
            "images": [media + VR1_IMAGES[0]],
            "problem_id": 2,
            "data_source": "ArxivQA",
        },
        {
            "id": "video-r1-2",
            "problem": "What is the value of x in the figure?",
            "answer": "3.5",
            "problem_type": "numerical",
            "data_type": "image",
            "images": [media + VR1_IMAGES[1]],
            "offline_output": "<think>Hmm, the angles sum to 180, so x = 3.5.</think>\n<answer>3.5</answer>",
            "problem_id": 3,
            "data_source": "Multimath-300k",
        },
        {
            "id": "video-r1-3",
            "problem": "What text is written on the sign?",
            "answer": "STOP AHEAD",
            "problem_type": "ocr",
            "data_type": "image",
            "images": [media + VR1_IMAGES[2]],
            "problem_id": 4,
            "data_source": "TextVQA",
        },
        {
            "id": "video-r1-4",
            "problem": "What does the man do after entering the kitchen?",
            "answer": "He opens the fridge.",
            "problem_type": "open-ended",
            "data_type": "video",
            "videos": [media + VR1_VIDEOS[1]],
            "problem_id": 5,
            "data_source": "STAR",
        },
        {
            "id": "video-r1-5",
            "problem": "How far is the chair from the table, in meters?",
            "answer": "1.25",
            "problem_type": "regression",
            "data_type": "video",
            "videos": [media + VR1_VIDEOS[2]],
            "problem_id": 6,
            "data_source": "SR-91k",
        },
        {
            "id": "video-r1-6",
            "problem": "How many people enter the room?",
            "answer": "3",
            "problem_type": "numerical",
            "data_type": "video",
            "videos": [media + VR1_VIDEOS[3]],
            "problem_id": 7,
            "data_source": "CLEVRER",
        },
    ]
    rows = read_jsonl(out)
    assert len(rows) == len(expected)
    for row, want in zip(rows, expected):
        assert row == want
    skipped = read_jsonl(tmp_path / "data" / "train.skipped.jsonl")
    assert [(s["index"], s["problem_id"], s["reason"]) for s in skipped] == [
        (7, 8, "invalid field 'answer'"),
        (8, 9, "media file missing"),
        (9, 10, "missing field 'solution'"),
    ]
    assert "'E' is not one of the option letters" in skipped[0]["detail"]
    assert skipped[1]["detail"] == str(video_r1 / "NeXT-QA/videos/not_downloaded.mp4")
    report = json.loads((tmp_path / "data" / "train.report.json").read_text())
    assert (report["converted"], report["skipped"], report["offline_output"]) == (7, 3, 2)
    assert report["reasons"] == {
        "invalid field 'answer'": 1,
        "media file missing": 1,
        "missing field 'solution'": 1,
    }

    # our loader resolves the written paths back to the release's files (../Video-R1-data: outside
    # data/, hence allow_outside)
    samples = data.load_samples(str(out), allow_outside=True)
    assert os.path.samefile(samples[0]["videos"][0], video_r1 / VR1_VIDEOS[0])
    assert os.path.samefile(samples[2]["images"][0], video_r1 / VR1_IMAGES[1])
    one = cache.Frames(
        video_min_frames=4, video_max_frames=4, video_min_pixels=784, video_max_pixels=784
    )
    frames, meta = cache.load_video(samples[0]["videos"][0], one, 28, mode="decode_only")
    assert frames.shape == (4, 28, 28, 3) and meta["total_num_frames"] == 4


def test_video_r1_without_flags(video_r1, tmp_path):
    """Without --offline-output no record carries one; without media checks the missing video is converted."""
    out = tmp_path / "train.jsonl"
    report = convert_data.main(
        convert_data.Config(
            source="video-r1",
            src=str(video_r1 / "Video-R1-260k.json"),
            out=str(out),
            check_media=False,
        )
    )
    rows = read_jsonl(out)
    assert (report["converted"], report["skipped"], report["offline_output"]) == (8, 2, 0)
    assert not any("offline_output" in row for row in rows)
    assert rows[-1]["id"] == "video-r1-8" and rows[-1]["videos"] == [
        "Video-R1-data/NeXT-QA/videos/not_downloaded.mp4"
    ]


def test_easyvideor1(tmp_path):
    media = tmp_path / "media"  # their data.image_dir
    make_media(str(media), ["videos/car.mp4", "videos/door.mp4"], ["images/cat.jpg"])
    out = tmp_path / "train.jsonl"
    args = [
        "--source",
        "easyvideor1",
        "--src",
        os.path.join(FIXTURES, "easyvideor1_train.jsonl"),
        "--media-root",
        str(media),
        "--out",
        str(out),
        "--offline-output",
    ]
    report = convert_data.main(
        tyro.cli(convert_data.Config, args=args)
    )  # the CLI's parser, in this process (fast)
    assert (report["converted"], report["skipped"], report["offline_output"]) == (13, 4, 1)
    car, door, cat = ["media/videos/car.mp4"], ["media/videos/door.mp4"], ["media/images/cat.jpg"]
    expected = [
        {
            "id": "easyvideor1-0",
            "problem": "<video>What color is the car?",
            "answer": "B",
            "problem_type": "multiple choice",
            "data_type": "video",
            "options": ["A. Red", "B. Blue", "C. Green", "D. White"],
            "videos": car,
            "offline_output": "<think>The car is blue.</think><answer>B</answer>",
            "problem_id": "mc-1",
            "data_source": "OneThinker",
        },
        {
            "id": "easyvideor1-1",
            "problem": "<image>Which animal is shown?",
            "answer": "A",  # tags stripped
            "problem_type": "multiple choice",
            "data_type": "image",
            "options": ["A. cat", "B. dog"],
            "images": cat,
            "problem_id": "mc-2",
            "data_source": "OneThinker",
        },  # has_offline_trajectory false: no offline_output
        {
            "id": "easyvideor1-2",
            "problem": "<video>When does the person open the door?",
            "answer": '{"time": [12.3, 25.7]}',
            "problem_type": "temporal grounding",
            "data_type": "video",
            "videos": door,
            "problem_id": "tg-1",
            "data_source": "Charades-STA",
        },
        {
            "id": "easyvideor1-3",
            "problem": "<video>Where and when is the dog running?",
            "answer": '{"time": [8.125, 10.483], "boxes": {"9": [317, 422, 582, 997], "10": [320, 420, 590, 990]}}',
            "problem_type": "spatial-temporal grounding",
            "data_type": "video",
            "videos": door,
            "problem_id": "stg-1",
            "data_source": "VidSTG",
        },
        {
            "id": "easyvideor1-4",
            "problem": "<image>Locate the red cup.",
            "answer": '{"boxes": [35, 227, 437, 932]}',
            "problem_type": "spatial grounding",
            "data_type": "image",
            "images": cat,
            "problem_id": "sg-1",
            "data_source": "RefCOCO",
        },
        {
            "id": "easyvideor1-5",
            "problem": "<video>Track the ball.",  # a JSON object answer becomes JSON text
            "answer": '{"boxes": {"1": [10, 10, 50, 50], "2": [12, 11, 52, 51]}}',
            "problem_type": "tracking",
            "data_type": "video",
            "videos": car,
            "problem_id": "tr-1",
            "data_source": "GOT-10k",
        },
        {
            "id": "easyvideor1-6",
            "problem": "<video>Is the door open at the end?",
            "answer": "Yes",
            "problem_type": "boolean",
            "data_type": "video",
            "videos": door,
            "problem_id": "bool-1",
        },
        {
            "id": "easyvideor1-7",
            "problem": "<video>How many cars pass?",
            "answer": "4",
            "problem_type": "numerical",
            "data_type": "video",
            "videos": car,
            "problem_id": "num-1",
        },
        {
            "id": "easyvideor1-8",
            "problem": "<video>How long is the bridge in meters?",
            "answer": "120",
            "problem_type": "regression",
            "data_type": "video",
            "videos": car,
            "problem_id": "reg-1",
        },
        {
            "id": "easyvideor1-9",
            "problem": "<video>What is happening in this video?",
            "answer": "A cat jumps onto the table.",
            "problem_type": "open-ended",
            "data_type": "video",
            "videos": door,
            "problem_id": "oe-1",
        },
        {
            "id": "easyvideor1-10",
            "problem": "<image>Read the license plate.",
            "answer": "AB 123",
            "problem_type": "ocr",
            "data_type": "image",
            "images": cat,
            "problem_id": "ocr-1",
        },
        {
            "id": "easyvideor1-11",
            "problem": "What is 7 * 6?",
            "answer": "42",
            "problem_type": "math",
            "data_type": "text",
            "problem_id": "math-1",
        },  # empty videos/images lists are left out
        {
            "id": "easyvideor1-12",
            "problem": "<image>Write an SVG that draws this icon.",
            "answer": '<svg xmlns="http://www.w3.org/2000/svg"><circle r="4"/></svg>',
            "problem_type": "svg-code",
            "data_type": "image",
            "images": cat,
            "problem_id": "code-1",
        },
    ]
    rows = read_jsonl(out)
    assert len(rows) == len(expected)
    for row, want in zip(rows, expected):
        assert row == want
    skipped = read_jsonl(tmp_path / "train.skipped.jsonl")
    assert [(s["index"], s["problem_id"], s["reason"]) for s in skipped] == [
        (13, "llava-1", "no reward for problem_type 'llava'"),
        (14, "bytes-1", "images not a list of file paths"),
        (15, "tg-bad", "invalid field 'answer'"),
        (16, None, "malformed JSON"),
    ]

    samples = data.load_samples(str(out))
    assert [s["id"] for s in samples] == [row["id"] for row in expected]
    assert os.path.samefile(samples[0]["videos"][0], media / "videos/car.mp4")
    assert os.path.samefile(samples[1]["images"][0], media / "images/cat.jpg")
    assert data.render_prompt(samples[0]).endswith(
        "Options:\nA. Red\nB. Blue\nC. Green\nD. White\n"
        "Answer with the option's letter. " + data.INSTRUCTIONS["answer"]
    )


def test_longvideo_reason(tmp_path):
    """LongVideo-Reason's records (NVlabs/Long-RL's release): `videos` one path, problem_type "general", the
    CoT in `reasoning`: with --offline-output, the SFT target <think>reasoning</think> + <answer>."""
    media = tmp_path / "longvila_videos"
    make_media(str(media), ["football_0001.mp4", "poker_0002.mp4", "starcraft_0004.mp4"], [])
    out = tmp_path / "sft.jsonl"
    src = os.path.join(FIXTURES, "longvideo_reason.json")
    args = ["--source", "longvideo-reason", "--src", src, "--media-root", str(media)]
    report = convert_data.main(
        tyro.cli(convert_data.Config, args=[*args, "--out", str(out), "--offline-output"])
    )
    assert (report["converted"], report["skipped"], report["offline_output"]) == (3, 2, 2)
    rows = read_jsonl(out)
    assert [(r["id"], r["problem_type"], r["answer"]) for r in rows] == [
        ("longvideo-reason-0", "multiple choice", "C"),
        ("longvideo-reason-1", "open-ended", "a pair of aces"),
        ("longvideo-reason-3", "open-ended", "The Zerg player"),
    ]
    assert rows[0]["videos"] == ["longvila_videos/football_0001.mp4"]
    assert rows[0]["offline_output"] == (
        "<think>Checking the video, the left back is sent off after a second yellow card. The team "
        "then plays with one defender fewer.</think>\n<answer>C</answer>"
    )  # in <think> tags once: record 1's reasoning has them already
    assert rows[1]["offline_output"] == (
        "<think>Analyzing the scene, seat 3 turns over two aces.</think>\n<answer>a pair of aces</answer>"
    )
    assert "offline_output" not in rows[2]  # no reasoning: an RL record only
    skipped = read_jsonl(tmp_path / "sft.skipped.jsonl")
    assert [(s["problem_id"], s["reason"]) for s in skipped] == [
        (2, "media file missing"),
        (4, "missing field 'videos'"),
    ]
    samples = data.load_samples(str(out))  # each written record passes the RL loader's checks
    assert [s["id"] for s in samples] == [r["id"] for r in rows]
    # the SFT target the reward scores as the ground truth (accuracy 1, format 1)
    import rewards

    total, parts = rewards.compute_reward(
        rows[0]["offline_output"], samples[0], 0.9, 0.1, "think_answer"
    )
    assert parts["accuracy"] == 1.0 and parts["format"] == 1.0
