"""SGLang's module paths for the frontend's backends (`sglang.lang.backend.runtime_endpoint` and the
like), so imports written for SGLang resolve with only the package name changed. The backends
themselves live in sglbus.lang.backends."""
