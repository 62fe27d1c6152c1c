import logging
import os
import subprocess
import sys
import threading
import uuid

import pytest
import torch

from layerckpt.io._backend import native_missing, uring_available

BACKENDS = ["uring", "threads"]

#: set to 1 to run the suite without the native module (a platform it does not build on); on Linux its absence
#: otherwise fails every test that needs it, with the build's reason, rather than skipping them
WITHOUT_NATIVE = "LAYERCKPT_TESTS_WITHOUT_NATIVE"
#: set to 1 where io_uring is known to work (CI): a kernel that refuses it then fails the uring tests, not skips them
REQUIRE_URING = "LAYERCKPT_TESTS_REQUIRE_URING"


def require_native(what: str) -> None:
    """Fails the calling test where the native module is missing on Linux (the build broke: say why), skips it
    where that is expected (another platform, or ``LAYERCKPT_TESTS_WITHOUT_NATIVE=1``)."""
    why = native_missing()
    if why is None:
        return
    if sys.platform.startswith("linux") and os.environ.get(WITHOUT_NATIVE) != "1":
        pytest.fail(f"{what} needs the native module: {why}. It builds on Linux; set {WITHOUT_NATIVE}=1 to run "
                    "the suite without it", pytrace=False)
    pytest.skip(f"{what}: {why}")


def require_uring(what: str) -> None:
    """``require_native``, then skips where this kernel refuses io_uring (or fails, with
    ``LAYERCKPT_TESTS_REQUIRE_URING=1``)."""
    require_native(what)
    why = uring_available()
    if why is None:
        return
    if os.environ.get(REQUIRE_URING) == "1":
        pytest.fail(f"{what}: {why}, and {REQUIRE_URING}=1 says io_uring works on this machine", pytrace=False)
    pytest.skip(f"io_uring unavailable here: {why}")



#: torch's intra-op threads as the suite started: a test that changes them (a CPU-bound run pinned to one thread,
#: say) must not change the arithmetic of the tests after it, whose expected tensors are computed here and
#: compared bit for bit with what other processes computed
_TORCH_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    yield
    if torch.get_num_threads() != _TORCH_THREADS:
        torch.set_num_threads(_TORCH_THREADS)

def pytest_collection_modifyitems(config, items):
    """The long runs (``@pytest.mark.slow``) stay out of the suite unless selected: ``-m slow``."""
    if "slow" in (config.option.markexpr or ""):
        return
    skip = pytest.mark.skip(reason="a long run: select it with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Runs a test once per I/O backend, forced the way users force it."""
    if request.param == "uring":
        require_uring("the uring backend")
    monkeypatch.setenv("LAYERCKPT_BACKEND", request.param)
    return request.param


def small_model(seed: int = 0) -> torch.nn.Module:
    from layerckpt.bench.models import GPT, GPTConfig

    torch.manual_seed(seed)
    return GPT(GPTConfig.tiny())


def trained(seed: int = 0, opt_cls=torch.optim.AdamW, steps: int = 2, **opt_kw):
    """A tiny GPT and its optimizer after a few real steps (so every state tensor exists)."""
    model = small_model(seed)
    opt = opt_cls(model.parameters(), **(opt_kw or {"lr": 1e-3}))
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 16), generator=g)
        loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def train_steps(model, opt, steps: int = 1, seed: int = 0) -> None:
    """``steps`` real optimizer steps of ``model`` (a tiny GPT) on seeded random tokens."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, 64, (2, 16), generator=g)
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def assert_same_tensors(sa: dict, sb: dict) -> None:
    """Two name -> tensor dicts, equal bit for bit (dtype and shape included)."""
    assert sa.keys() == sb.keys()
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert torch.equal(sa[k], sb[k]), k


def assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    assert_same_tensors(a.state_dict(), b.state_dict())


def assert_same_optimizer_state(sa: dict, sb: dict) -> None:
    """Two Optimizer.state_dict() results, equal bit for bit."""
    assert sa["param_groups"] == sb["param_groups"]
    assert sa["state"].keys() == sb["state"].keys()
    for i in sa["state"]:
        assert sa["state"][i].keys() == sb["state"][i].keys()
        for k, v in sa["state"][i].items():
            w = sb["state"][i][k]
            if isinstance(v, torch.Tensor):
                assert v.dtype == w.dtype and v.shape == w.shape and torch.equal(v, w), (i, k)
            else:
                assert v == w, (i, k)


def assert_same_optimizer(a: torch.optim.Optimizer, b: torch.optim.Optimizer) -> None:
    assert_same_optimizer_state(a.state_dict(), b.state_dict())


def run_py(code: str, *args: str, timeout: float = 120, env=None, preexec_fn=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})}, preexec_fn=preexec_fn)


# ------------------------------------------------------------------ an S3 server on loopback (remote tier tests)

class S3:
    """moto's S3 server on a free loopback port, with every request it answered."""

    def __init__(self):
        from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise
        app = DomainDispatcherApplication(create_backend_app)
        self.requests = []

        def logged(environ, start_response):
            self.requests.append((environ["REQUEST_METHOD"], environ["PATH_INFO"], environ.get("QUERY_STRING", ""),
                                  environ.get("HTTP_RANGE", "")))
            return app(environ, start_response)

        self._server = make_server("127.0.0.1", 0, logged, threaded=True, request_handler=MotoRequestHandler)
        self.endpoint = "http://127.0.0.1:%d" % self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        self.options = {"key": "testing", "secret": "testing",
                        "client_kwargs": {"endpoint_url": self.endpoint, "region_name": "us-east-1"}}

    def bucket(self) -> str:
        import boto3

        name = "ckpt-" + uuid.uuid4().hex[:12]
        boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                     region_name="us-east-1").create_bucket(Bucket=name)
        return name

    def written(self, prefix: str):
        """Object keys under ``prefix`` that got a PUT (whole objects and multipart parts)."""
        return {p.split(prefix, 1)[1].lstrip("/") for meth, p, *_ in self.requests
                if meth == "PUT" and prefix in p}

    def stop(self):
        self._server.shutdown()
        self._thread.join()


@pytest.fixture(scope="module")
def s3():
    # moto and s3fs come with the [test] extra, as lightning, accelerate, transformers, peft, fsspec, tqdm,
    # matplotlib and tensorboard do: the tests import them plainly, so a broken install fails, never skips
    import s3fs  # noqa: F401
    import moto.server  # noqa: F401
    server = S3()
    yield server
    server.stop()


def stored_byte(entry: dict) -> int:
    """The file offset of a byte in the middle of a manifest tensor entry's stored bytes (its first encoded
    block where it is encoded), for tests that damage one tensor."""
    if entry.get("enc"):
        off, n = next(b[:2] for b in entry["enc"]["blocks"] if b[1] > 0)  # not an unchanged block: it holds none
        return off + n // 2
    return entry["offset"] + entry["nbytes"] // 2


@pytest.fixture
def manifest_parses(monkeypatch):
    """The base names of the manifests parsed and validated whole (``Manifest.from_dict``), in order."""
    from layerckpt.format import _manifest

    parsed = []
    real = _manifest.Manifest.from_dict.__func__

    def counted(cls, m, path):
        parsed.append(os.path.basename(path))
        return real(cls, m, path)

    monkeypatch.setattr(_manifest.Manifest, "from_dict", classmethod(counted))
    return parsed


@pytest.fixture(params=["s3", "memory", "file"])
def remote(request, tmp_path):
    """(url, fsspec options) of a fresh, empty remote of each kind: S3 (moto's server), memory://, file://."""
    if request.param == "s3":
        s3 = request.getfixturevalue("s3")
        return f"s3://{s3.bucket()}/run", s3.options
    if request.param == "memory":
        return f"memory://ckpt-{uuid.uuid4().hex[:12]}/run", {}
    return "file://" + str(tmp_path / "remote" / "run"), {}
