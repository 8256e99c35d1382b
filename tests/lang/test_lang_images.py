"""sgl.image and sgl.video without a model: the image token goes in the text where the image is, and
every request on that text carries the images as `image_data`, in order (paths read and base64-encoded
here, bytes encoded, data URLs and base64 as they are); forks, joins, run_batch and compiled runs carry
their prefix's images; a video becomes num_frames evenly sampled frames, one image each (from a list of
frames, or from a file decoded with PyAV when it is installed)."""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np
import pytest
from scripted_backend import ScriptedBackend

import sglbus as sgl
from sglbus.lang import media
from sglbus.lang.backends.native import NativeBackend


class VisionBackend(ScriptedBackend):
    """The scripted backend for a vision-language model: it takes images and names its image token."""

    def __init__(self, *scripts: str, template: str = "default", token: str = "<image>") -> None:
        super().__init__(*scripts, template=template)
        self.token = token

    def get_model_info(self) -> dict[str, Any]:
        return {"model_path": "scripted-llava", "has_image_understanding": True}

    def image_token(self) -> str:
        return self.token

    def _request(self, body: dict[str, Any]) -> Any:
        if isinstance(body["sampling_params"], list):  # a batch with each prompt's own parameters
            self.bodies.append(body)
            return [self._continue(t, p) for t, p in zip(body["text"], body["sampling_params"], strict=True)]
        return super()._request(body)


def png(value: int, size: tuple[int, int] = (8, 6)) -> bytes:
    from PIL import Image

    out = io.BytesIO()
    Image.fromarray(np.full((*size, 3), value, dtype=np.uint8)).save(out, format="PNG")
    return out.getvalue()


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def gray(item: str) -> int:
    """The value of a uniform test image sent as base64."""
    from PIL import Image

    return int(np.asarray(Image.open(io.BytesIO(base64.b64decode(item)))).mean().round())


CAT, DOG = png(10), png(200)


@sgl.function
def describe(s, picture):
    s += "Describe " + sgl.image(picture) + " briefly:"
    s += sgl.gen("d", max_tokens=4)


def test_a_path_is_read_and_encoded_and_the_token_is_where_the_image_was(tmp_path):
    path = tmp_path / "cat.png"
    path.write_bytes(CAT)
    backend = VisionBackend("Describe <image> briefly: a cat")
    state = describe.run(picture=str(path), backend=backend)
    assert state.error() is None and state["d"] == " a c"
    (body,) = backend.bodies
    assert body["text"] == "Describe <image> briefly:"
    assert body["image_data"] == [b64(CAT)]
    assert state.text() == "Describe <image> briefly: a c"
    state = describe.run(picture=path, backend=backend)  # a pathlib.Path too
    assert backend.bodies[-1]["image_data"] == [b64(CAT)]


@pytest.mark.parametrize(
    ("picture", "sent"),
    [
        (CAT, b64(CAT)),
        (bytearray(CAT), b64(CAT)),
        ("data:image/png;base64," + b64(CAT), "data:image/png;base64," + b64(CAT)),
        (b64(CAT), b64(CAT)),
        ("https://example.com/cat.png", "https://example.com/cat.png"),  # the runtime decides
        (np.full((8, 6, 3), 10, dtype=np.uint8), b64(CAT)),
    ],
    ids=["bytes", "bytearray", "data-url", "base64", "url", "numpy"],
)
def test_each_form_of_an_image_is_sent_as_sglang_sends_it(picture, sent):
    backend = VisionBackend()
    assert describe.run(picture=picture, backend=backend).error() is None
    assert backend.bodies[0]["image_data"] == [sent]


def test_a_pil_image_is_sent_as_png():
    from PIL import Image

    backend = VisionBackend()
    describe.run(picture=Image.open(io.BytesIO(DOG)), backend=backend).sync()
    assert gray(backend.bodies[0]["image_data"][0]) == 200


def test_images_go_in_order_and_again_with_every_later_gen():
    @sgl.function
    def compare(s):
        s += "A: " + sgl.image(CAT) + " B: " + sgl.image(DOG) + "\nSame?"
        s += sgl.gen("same", max_tokens=3)
        s += "\nThird: " + sgl.image(png(90)) + "?"
        s += sgl.gen("third", max_tokens=3)

    backend = VisionBackend()
    assert compare.run(backend=backend).error() is None
    first, second = backend.bodies
    assert first["text"] == "A: <image> B: <image>\nSame?"
    assert first["image_data"] == [b64(CAT), b64(DOG)]
    assert second["text"].count("<image>") == 3
    assert second["image_data"] == [b64(CAT), b64(DOG), b64(png(90))]  # the server is stateless


def test_a_text_prompt_sends_no_image_data():
    backend = VisionBackend()

    @sgl.function
    def plain(s):
        s += "Hello" + sgl.gen("x", max_tokens=2)

    plain.run(backend=backend).sync()
    assert "image_data" not in backend.bodies[0]


def test_forks_carry_the_images_of_their_prefix_and_join_carries_a_branchs_own():
    @sgl.function
    def branches(s):
        s += "Look: " + sgl.image(CAT) + "\n"
        forks = s.fork(2)
        forks[0] += "Color?" + sgl.gen("a", max_tokens=2)
        forks[1] += "And " + sgl.image(DOG) + " size?" + sgl.gen("a", max_tokens=2)
        forks.join("concate_and_append")
        s += "Both:" + sgl.gen("both", max_tokens=2)

    backend = VisionBackend()
    state = branches.run(backend=backend)
    assert state.error() is None
    hint, *gens, last = backend.bodies
    assert hint == {
        "text": "Look: <image>\n",
        "sampling_params": {"max_new_tokens": 0},
        "image_data": [b64(CAT)],
    }
    by_text = {b["text"]: b["image_data"] for b in gens}
    assert by_text == {
        "Look: <image>\nColor?": [b64(CAT)],
        "Look: <image>\nAnd <image> size?": [b64(CAT), b64(DOG)],
    }
    assert last["text"].count("<image>") == 2  # the parent, its own image, then the joined branch's
    assert last["image_data"] == [b64(CAT), b64(DOG)]


def test_run_batch_sends_each_runs_own_images():
    backend = VisionBackend()
    states = describe.run_batch([{"picture": CAT}, {"picture": DOG}], backend=backend, num_threads=2)
    assert all(s.error() is None for s in states)
    assert sorted(b["image_data"][0] for b in backend.bodies) == sorted([b64(CAT), b64(DOG)])


def test_a_compiled_program_takes_an_image_argument_and_batches_per_prompt_images():
    @sgl.function
    def maybe(s, picture, question):
        s += question + sgl.image(picture) + sgl.gen("a", max_tokens=2)

    compiled = maybe.compile()
    backend = VisionBackend()
    states = compiled.run_batch(
        [{"picture": CAT, "question": "One "}, {"picture": DOG, "question": "Two "}], backend=backend
    )
    assert all(s.error() is None for s in states)
    (batch,) = backend.bodies  # one batch request: one image_data entry per prompt
    assert batch["text"] == ["One <image>", "Two <image>"]
    assert batch["image_data"] == [[b64(CAT)], [b64(DOG)]]


def test_a_batch_with_text_and_image_prompts_gives_null_for_the_text_ones():
    from sglbus.lang.interpreter import Prompt
    from sglbus.lang.params import SamplingParams

    backend = VisionBackend()
    params = SamplingParams(max_new_tokens=2)
    backend.generate_batch(["plain", Prompt("pic <image>", (b64(CAT),))], [params, params])
    assert backend.bodies[0]["image_data"] == [None, [b64(CAT)]]


def test_the_chat_templates_spacing_of_the_same_token_is_kept_and_another_token_is_not():
    @sgl.function
    def in_turn(s):
        s += sgl.user(sgl.image(CAT) + "What is it?")

    vicuna = in_turn.run(backend=VisionBackend(template="vicuna_v1.1"))
    assert "USER: <image>\nWhat is it?" in vicuna.text()  # SGLang's LLaVA-1.5 format
    llama3 = in_turn.run(backend=VisionBackend(template="llama-3-instruct"))  # its token is <|image|>
    assert "<image>What is it?" in llama3.text() and "<|image|>" not in llama3.text()


def test_video_from_a_list_of_frames_becomes_num_frames_images_sampled_evenly():
    frames = [np.full((6, 6, 3), 20 * i, dtype=np.uint8) for i in range(10)]

    @sgl.function
    def clip(s, frames, count):  # (n is run()'s own argument)
        s += "Video: " + sgl.video(frames, count) + "\nWhat happens?" + sgl.gen("a", max_tokens=2)

    backend = VisionBackend()
    assert clip.run(frames=frames, count=4, backend=backend).error() is None
    body = backend.bodies[0]
    assert body["text"] == "Video: " + "<image>" * 4 + "\nWhat happens?"
    assert [gray(x) for x in body["image_data"]] == [0, 60, 120, 180]  # frames 0, 3, 6, 9
    clip.run(frames=[CAT, DOG, b64(CAT)], count=3, backend=backend).sync()  # any image form is a frame
    assert backend.bodies[-1]["image_data"] == [b64(CAT), b64(DOG), b64(CAT)]
    clip.run(frames=np.stack(frames), count=2, backend=backend).sync()  # an array of frames
    assert [gray(x) for x in backend.bodies[-1]["image_data"]] == [0, 180]


def test_sample_indices_are_sglangs_linspace():
    for total in (1, 2, 7, 10, 31, 300):
        for n in (1, 2, 3, 4, 8, 16):
            assert media.sample_indices(total, n) == np.linspace(0, total - 1, n, dtype=int).tolist()


def test_refusals_are_clear():
    @sgl.function
    def one(s, picture):
        s += sgl.image(picture) + sgl.gen("a", max_tokens=2)

    state = one.run(picture=CAT, backend=ScriptedBackend())  # a text model
    assert "text-only model" in str(state.error())
    state = one.run(picture="no/such/cat.png", backend=VisionBackend())
    assert isinstance(state.error(), FileNotFoundError) and "no file 'no/such/cat.png'" in str(state.error())
    state = one.run(picture=3.5, backend=VisionBackend())
    assert isinstance(state.error(), TypeError) and "a file path, bytes" in str(state.error())
    state = one.run(picture=np.zeros((4, 4), dtype=np.float32), backend=VisionBackend())
    assert "must be uint8" in str(state.error())
    with pytest.raises(ValueError, match="num_frames must be an integer >= 1"):
        sgl.video([CAT], 0)

    class NoImages(VisionBackend):
        sends_images = False

    assert "NoImages does not send images" in str(one.run(picture=CAT, backend=NoImages()).error())
    assert not sgl.BusEndpoint.sends_images and not sgl.OpenAI.sends_images
    assert NativeBackend.sends_images


def test_a_video_file_without_pyav_names_the_package(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "av", None)  # `import av` raises ImportError
    path = tmp_path / "clip.mp4"
    path.write_bytes(b"not decoded")
    with pytest.raises(ImportError, match=r"needs PyAV: pip install av .*sglbus\[video\]"):
        media.video_frames(str(path), 4)


def write_video(path: str, frames: int, codec: str) -> None:
    """frames frames of 32x32, frame i a uniform gray of 20 * i."""
    av = pytest.importorskip("av")
    with av.open(path, "w") as out:
        stream = out.add_stream(codec, rate=10)
        stream.width = stream.height = 32
        stream.pix_fmt = "yuv420p"
        for i in range(frames):
            image = np.full((32, 32, 3), 20 * i, dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)


@pytest.mark.parametrize("name", ["clip.mp4", "clip.mkv"])  # mkv does not store the frame count
def test_a_video_file_is_sampled_evenly_to_num_frames(tmp_path, name):
    path = str(tmp_path / name)
    write_video(path, 10, "mpeg4")
    backend = VisionBackend()

    @sgl.function
    def clip(s, video):
        s += sgl.video(video, 4) + "What happens?" + sgl.gen("a", max_tokens=2)

    assert clip.run(video=path, backend=backend).error() is None
    body = backend.bodies[0]
    assert body["text"] == "<image>" * 4 + "What happens?"
    values = [gray(x) for x in body["image_data"]]
    assert all(abs(v - want) <= 4 for v, want in zip(values, [0, 60, 120, 180], strict=True)), values
    with open(path, "rb") as f:  # the file's bytes decode the same
        assert media.video_frames(f.read(), 4) == body["image_data"]
    assert len(media.video_frames(path, 16)) == 16  # a short video repeats frames, as SGLang's


def test_a_file_that_is_no_video_is_a_clear_error(tmp_path):
    pytest.importorskip("av")
    path = tmp_path / "clip.mp4"
    path.write_bytes(b"not a video at all")
    with pytest.raises(ValueError, match="video: cannot read .*clip.mp4.* as a video"):
        media.video_frames(str(path), 4)
    with pytest.raises(FileNotFoundError, match="video: no file"):
        media.video_frames(str(tmp_path / "missing.mp4"), 4)


@pytest.fixture
def stub_server():
    """A stand-in for the server's native API: /get_model_info of a LLaVA model, and /generate
    answering "ok" while recording each JSON body."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    bodies: list[dict[str, Any]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._reply({"model_path": "llava-stub", "tokenizer_path": "", "has_image_understanding": True})

        def do_POST(self) -> None:
            bodies.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            self._reply({"text": "ok", "meta_info": {"prompt_tokens": 1, "finish_reason": {"type": "stop"}}})

        def _reply(self, obj: Any) -> None:
            data = json.dumps(obj).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", bodies
    server.shutdown()
    server.server_close()


def test_runtime_endpoint_posts_the_images_with_the_text(stub_server, tmp_path):
    url, bodies = stub_server
    path = tmp_path / "cat.png"
    path.write_bytes(CAT)
    backend = sgl.RuntimeEndpoint(url)
    assert backend.image_token() == "<image>"  # our /get_model_info does not name it: LLaVA's
    state = describe.run(picture=str(path), backend=backend)
    assert state.error() is None and state["d"] == "ok"
    assert bodies[-1]["text"] == "Describe <image> briefly:" and bodies[-1]["image_data"] == [b64(CAT)]
