#!/usr/bin/env bash
# SGLang 0.5.23 (issue 18) and vLLM 0.33.0 (issue 23) for the offline H200 host (image:
# Python 3.12, torch 2.11+cu130, triton 3.6, CUDA 13.0 libraries; 64 MiB per call), on
# torch 2.14.1 staged beside the image's packages. Sequence and findings: tests/gpu/README.md.
#
# Here (network): bash tests/gpu/stage-stack.sh build [OUT]      (OUT default .whl-stack,
#   git-ignored) downloads the wheels, trims the big ones, cuts them into OUT/p01, p02, ...
#   of at most 58 MiB and prints which pieces make which set (also OUT/SUMMARY.txt).
# There, one call per piece, back to back while the host is warm (carry OUT/pNN):
#   bash tests/gpu/stage-stack.sh put .whl-stack/pNN    moves the parts to /tmp/stack-pieces,
#       installs every wheel whose parts are all there (sha256 checked) into
#       /tmp/stack-<group>, says which pieces are still missing; putting one twice is harmless.
#   bash tests/gpu/stage-stack.sh status
#   eval "$(bash tests/gpu/stage-stack.sh env sglang)"   (or vllm): PYTHONPATH and friends
#   bash tests/gpu/stage-stack.sh smoke sglang|vllm      versions, imports, CUDA, NCCL, Triton
# tests/gpu/stage.sh's prepare_run uses the sglang stack when KIMI_SGLANG_SERIES names the
# series whose SGLang release the stack holds.
#
# Sets: sglang (SGLang), vllm and vllm-fa3 (vLLM; vllm-fa3 is FlashAttention 3, vLLM's
# attention on Hopper: skip it only when serving with --attention-backend TRITON_ATTN),
# chained in one stream (p01-p20: sglang completes in p17, where vllm begins), and
# optional ones, each in pieces of its own outside the default sequence:
# opt-triton38 (triton 3.8, what torch 2.14.1 pins; the image's 3.6 is tried first),
# opt-sgl-fi-jit / opt-vllm-fi-jit (FlashInfer's JIT sources, dropped from the staged
# FlashInfer wheels: only kernels compiled on first use need them).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}

build() {
  local out=${1:-.whl-stack}
  mkdir -p "$out/dl" "$out/files"
  local dl=$out/dl files=$out/files
  local P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
           --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
           --platform manylinux_2_24_x86_64 --platform manylinux_2_18_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any -q)
  # Every wheel goes to its own folder: two sets may pin two versions of one package.
  fetch() { local d=$dl/$1; shift; mkdir -p "$d"; "$py" -m pip download "${P[@]}" -d "$d" "$@"; }
  whl() {  # the one wheel of that name in folder $1
    local f
    for f in "$dl/$1/$2"-*.whl; do [ -f "$f" ] && { echo "$f"; return; }; done
    echo "missing $1/$2" >&2; exit 1
  }

  # --- sglang: torch 2.14.1 and what SGLang 0.5.23's server, scheduler and model runner
  # import beyond the image (found by importing them in a CPU venv that mimics the image)
  fetch nccl nvidia-nccl-cu13==2.30.7   # the image's NCCL lacks ncclCommResume, torch 2.14.1 needs it
  fetch torch torch==2.14.1 torchvision==0.29.1   # the image's torchvision 0.26 breaks import under torch 2.14
  fetch sgl sglang==0.5.23 sglang-kernel==0.4.10 flashinfer-python==0.7.2 transformers==5.19.0 \
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4 pydantic-core==2.50.5 \
    annotated-types==0.8.0 typing-inspection==0.4.5 orjson==3.13.0 msgspec==0.22.0 pyzmq==27.3.0 \
    pybase64==1.5.1 python-multipart==0.0.34 setproctitle==1.3.8 partial-json-parser==0.2.1.1.post7 \
    interegular==0.3.3 openai==2.8.0 jiter==0.19.0 distro==1.9.0 sniffio==1.3.1 \
    ipython==9.18.1 traitlets==5.16.1 jedi==0.20.1 parso==0.8.7 prompt-toolkit==3.0.53 pexpect==4.9.0 \
    ptyprocess==0.7.0 decorator==5.3.1 matplotlib-inline==0.2.2 stack-data==0.6.3 executing==2.3.0 \
    asttokens==3.0.2 pure-eval==0.2.4 wcwidth==0.9.4 ipython-pygments-lexers==1.1.1 \
    opentelemetry-api==1.45.2 importlib-metadata==10.2.0 apache-tvm-ffi==0.1.11 cffi==2.1.1 \
    compressed-tensors==0.18.0 dill==0.4.1 gguf==0.19.0 jsonschema==4.26.0 \
    jsonschema-specifications==2025.9.1 loguru==0.7.3 pycparser==3.12 referencing==0.37.0 \
    rpds-py==2026.9.1 soundfile==0.13.1 xgrammar==0.2.7 quack-kernels==0.6.5 \
    nvidia-cutlass-dsl==4.8.0 nvidia-cutlass-dsl-libs-base==4.8.0 nvidia-cutlass-dsl-libs-cu13==4.8.0 \
    nvidia-cutlass-dsl-libs-core==4.8.0 torch-c-dlpack-ext
  # (cutlass DSL: imported on CUDA when a Llama layer is built, by sglang/srt/layers/dual_gemm.py
  # -> sglang/kernels/ops/gemm/cutedsl_dual_gemm.py; seen missing on the H200 on 2026-12-01.
  # SGLang pins nvidia-cutlass-dsl[cu13]: the cu13 libraries only, not the default cu12 ones.
  # libs-base's own dependency libs-core holds the Python package (cutlass.cute); libs-base
  # only its MLIR bindings. quack-kernels wants torch-c-dlpack-ext. The image has
  # cuda-bindings, protobuf and einops.)
  # --- vllm: vLLM 0.33.0 and what `vllm serve` with extract_hidden_states and
  # ExampleHiddenStatesConnector imports beyond the image and the sglang set (which it
  # reuses: vLLM's site comes first), versions as vLLM pins them where the sglang set's differ
  fetch vllm vllm==0.33.0 flashinfer-python==0.7.2.post1 openai==2.54.0 oss-harmony==0.0.11 \
    fastapi==0.136.1 compressed-tensors==0.17.0 cbor2==6.3.0 cachetools==8.0.2 py-cpuinfo==9.0.0 \
    llguidance==1.7.6 watchfiles==1.3.0 prometheus-fastapi-instrumentator==8.1.0 \
    model-hosting-container-standards==0.1.16 jmespath==1.1.0 ijson==3.5.0 blake3==1.0.8 \
    hs-connectors==0.9.0
  fetch triton triton==3.8.0

  # --- trims (reproducible: same input, same bytes)
  local t="$py $here/stack_pieces.py"
  local fi_jit=('flashinfer/data/csrc/*' 'flashinfer/data/cutlass/*' 'flashinfer/data/cccl/*'
                'flashinfer/data/include/*' 'flashinfer/data/spdlog/*')
  local f
  # sgl_kernel without FA3 (1.1 GB; SGLang uses --attention-backend triton), sm100 ops,
  # FlashMLA and InfLLM (other attention backends)
  f=$(whl sgl sglang_kernel-0.4.10)
  [ -f "$files/$(basename "$f")" ] || $t trim "$f" "$files/$(basename "$f")" 'sgl_kernel/flash_ops*' \
    'sgl_kernel/sm100/*' 'sgl_kernel/flashmla_ops*' 'sgl_kernel/infllm_ops*'
  f=$(whl sgl flashinfer_python-0.7.2)
  [ -f "$files/$(basename "$f")" ] || $t trim "$f" "$files/$(basename "$f")" "${fi_jit[@]}"
  [ -f "$files/flashinfer-0.7.2-jit.tar.gz" ] || $t take "$f" "$files/flashinfer-0.7.2-jit.tar.gz" "${fi_jit[@]}"
  f=$(whl vllm flashinfer_python-0.7.2.post1)
  [ -f "$files/$(basename "$f")" ] || $t trim "$f" "$files/$(basename "$f")" "${fi_jit[@]}"
  [ -f "$files/flashinfer-0.7.2.post1-jit.tar.gz" ] || $t take "$f" "$files/flashinfer-0.7.2.post1-jit.tar.gz" "${fi_jit[@]}"
  # vLLM without FlashAttention 2 (pre-Hopper), FA3 (its own set), the Rust frontend
  # (VLLM_USE_RUST_FRONTEND only), DeepGEMM, SM100 FMHA, DSA and KDA kernels
  f=$(whl vllm vllm-0.33.0)
  [ -f "$files/$(basename "$f")" ] || $t trim "$f" "$files/$(basename "$f")" \
    'vllm/vllm_flash_attn/_vllm_fa2_C*' 'vllm/vllm_flash_attn/_vllm_fa3_C*' 'vllm/vllm-rs' \
    'vllm/third_party/deep_gemm/*' 'vllm/third_party/fmha_sm100/*' 'vllm/_deepselect_C*' 'vllm/_flashkda_C*'
  [ -f "$files/vllm-0.33.0-fa3.tar.gz" ] || $t take "$f" "$files/vllm-0.33.0-fa3.tar.gz" 'vllm/vllm_flash_attn/_vllm_fa3_C*'
  # triton 3.8 without Blackwell's ptxas, CUPTI and the profiler's library (proton); AMD's
  # backend stays: triton imports every backend its entry points name
  f=$(whl triton triton-3.8.0)
  [ -f "$files/$(basename "$f")" ] || $t trim "$f" "$files/$(basename "$f")" \
    'triton/backends/nvidia/bin/ptxas-blackwell' 'triton/backends/nvidia/lib/cupti-blackwell/*' \
    'triton/backends/nvidia/lib/cupti/*' 'triton/_C/libproton.so'

  # --- the spec: SET GROUP KIND FILE, in install order
  local spec=$out/spec.txt name
  : > "$spec"
  add() { echo "$1 $2 $3 $4" >> "$spec"; }
  from() {  # the trimmed copy when there is one
    if [ -f "$files/$(basename "$1")" ]; then echo "$files/$(basename "$1")"; else echo "$1"; fi; }
  add sglang nccl wheel "$(whl nccl nvidia_nccl_cu13-2.30.7)"
  add sglang torch wheel "$(whl torch torch-2.14.1)"
  add sglang torch wheel "$(whl torch torchvision-0.29.1)"
  for f in "$dl"/sgl/*.whl; do add sglang sgl wheel "$(from "$f")"; done
  for f in "$dl"/vllm/*.whl; do add vllm vllm wheel "$(from "$f")"; done
  add vllm-fa3 vllm tar "$files/vllm-0.33.0-fa3.tar.gz"
  add opt-triton38 triton wheel "$(from "$(whl triton triton-3.8.0)")"
  add opt-sgl-fi-jit sgl tar "$files/flashinfer-0.7.2-jit.tar.gz"
  add opt-vllm-fi-jit vllm tar "$files/flashinfer-0.7.2.post1-jit.tar.gz"
  # two sets may stage one file name only once; the same wheel in both is a mistake here
  name=$(awk '{n=split($4,a,"/"); print a[n]}' "$spec" | sort | uniq -d)
  [ -z "$name" ] || { echo "staged twice: $name" >&2; exit 1; }
  $t pack "$out" "$spec" --chain sglang,vllm,vllm-fa3 | tee "$out/SUMMARY.txt"
  du -sh "$out"/p* | sort -k2 | tr '\n' ' '; echo
}

case "${1:-}" in
  build) shift; build "$@" ;;
  put) shift; exec "$py" "$here/stack_pieces.py" put "$@" ;;
  status) exec "$py" "$here/stack_pieces.py" status ;;
  env) exec "$py" "$here/stack_pieces.py" env "${2:-sglang}" ;;
  smoke)
    stack=${2:-sglang}
    eval "$("$py" "$here/stack_pieces.py" env "$stack")"
    PYTHONUNBUFFERED=1 exec "$py" "$here/smoke_stack.py" "$stack" "${@:3}" ;;
  *) sed -n '2,17p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
