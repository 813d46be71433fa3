#!/usr/bin/env bash
# One device session: GPU tests and/or the end-to-end benchmark, logs under $OUT.
#   bash benchmarks/gpu_session.sh tests   # tests/gpu (kernels, model, execution incl. 2-GPU split)
#   bash benchmarks/gpu_session.sh bench   # dflash bench, 9B-shaped model, A/B/A
#   BEFORE=DIR bash benchmarks/gpu_session.sh bench-ab  # the same bench: DIR's dflash (a
#                                          # checkout's dflash/ under DIR), this tree's, DIR's again
#                                          # (ORDER="after before after2": the other way round)
#   bash benchmarks/gpu_session.sh recompute # dflash bench A/B/A: checkpoint vs recompute (and remap),
#                                          # 9B shape at block 16 and 64, 27B shape at block 16
#   bash benchmarks/gpu_session.sh trees   # tree GPU tests (every mode, tree recompute kernels), a
#                                          # profile of a 64-node tree step, then
#                                          # dflash bench A/B/A checkpoint vs recompute with trees of
#                                          # 64 and 16 nodes (9B, 27B at 64) and the chain (9B, block 16)
#   bash benchmarks/gpu_session.sh default-trees # the default pair with trees of 16, 32, 64
#                                          # nodes (candidates drafted on the device) against its
#                                          # chain: dflash bench A/B/A (DEFAULT_BUDGETS="0 16 ...")
#   bash benchmarks/gpu_session.sh sampling # the rule's GPU tests, benchmarks/sampling_cost.py,
#                                          # dflash bench sampled (9B synthetic; default pair)
#   bash benchmarks/gpu_session.sh accept  # the rule's GPU tests (graphed acceptance), top-p's mass
#                                          # pass by launch config (benchmarks/filter_mass.py),
#                                          # sampling_cost.py (+ --profile)
#   bash benchmarks/gpu_session.sh filters # the filters' GPU tests, sampling_cost.py (+ --profile;
#                                          # HEAD_SCALE=4: also on a peaked distribution),
#                                          # dflash bench with top-k 20, top-p 0.95 (9B; default pair)
#   bash benchmarks/gpu_session.sh long    # the prefill kernels' GPU tests, then
#                                          # benchmarks/long_context.py: 9B prefill tok/s and peak
#                                          # memory from 8k to 262,144 tokens, decode at each
#                                          # (LONG_TESTS=0, GDN=chunked|recurrent, PROFILE=LENGTH)
#   bash benchmarks/gpu_session.sh serve   # benchmarks/serve_load.py on cuda:0 (the default pair):
#                                          # one client, then eight (needs the fastapi, uvicorn,
#                                          # httpx and openai wheels and theirs under .whl/)
#   bash benchmarks/gpu_session.sh tiles   # the attention's row tiles per program (1, 2, 4) by
#                                          # warps at 8k and 128k keys, T = 1 and 16, with the
#                                          # rows' bits against one-row calls; attention/tree tests
#   bash benchmarks/gpu_session.sh spec128k # dflash bench at 131,072 tokens over 1,024 new
#                                          # tokens (TOKENS_128K), checkpoint vs remap vs plain
#   bash benchmarks/gpu_session.sh tiles128k # dflash bench at 131,072 tokens (9B, synthetic, block
#                                          # 16) with 1 and 4 row tiles (TILE_COUNTS="1 2 4")
#   bash benchmarks/gpu_session.sh fp8     # the FP8 linear's GPU tests, then dflash bench A/B/A with
#                                          # --quantize fp8 (9B and 27B shapes, synthetic drafter;
#                                          # FP8_TESTS=0, FP8_SHAPES="nine-b-shape",
#                                          # FP8_FORMS="default none x_major", FP8_RUNS,
#                                          # FP8_QUANT=fp8-lm-head: the LM head in FP8 too)
#   bash benchmarks/gpu_session.sh glue    # the fused glue: tests/gpu/test_fused_glue_gpu.py, then
#                                          # benchmarks/forward_kernels.py (a graphed forward's GPU
#                                          # time by part and the host's time to issue it, bf16
#                                          # and FP8, T = 1, 16, 64; trees of 16 and 64); then
#                                          # BEFORE=DIR ... glue bench-ab: against the unfused code
#   bash benchmarks/gpu_session.sh hot     # benchmarks/hot_kernels.py: decode attention, FP8 linear
#                                          # and GDN prefill against their floors (HOT_PARTS=...;
#                                          # also "tiles", and "prefill": the prefill attention's
#                                          # tiles, warps and stages in TFLOPS)
#   bash benchmarks/gpu_session.sh fp8-shapes # benchmarks/fp8_shapes.py: each 9B projection
#                                          # launch (FP8 groups fused and their members) against
#                                          # its floor, split-K in the kernel on and off, a sweep
#   bash benchmarks/gpu_session.sh wide    # the wide-verify linear: GPU tests + benchmarks/linear_wide.py
#                                          # + benchmarks/wide_mma.py (wide row tiles: bits, µs)
#   bash benchmarks/gpu_session.sh kernels # benchmarks/kernels.py (kernels-sweep: with its config sweep)
#   bash benchmarks/gpu_session.sh cli     # dflash generate on two GPUs, every drafter
#   bash benchmarks/gpu_session.sh minv    # M-invariant linear/attention: GPU tests + kernel table
#   bash benchmarks/gpu_session.sh parity  # plain greedy vs every rollback mode (CLI, --check-parity)
#   bash benchmarks/gpu_session.sh graphs  # tests/gpu/test_graphs.py (graphs vs eager, 9B 1,024-token parity)
#   bash benchmarks/gpu_session.sh profile # benchmarks/profile_step.py: wall vs GPU time, graphs off/on
#   bash benchmarks/gpu_session.sh drafter # the default pair's drafter stage (scripts/build_default.py)
#   bash benchmarks/gpu_session.sh drafter2 # a DFlash2 drafter for the default pair (one call's worth)
# Expects the wheels the device lacks under .whl/ (scripts/device_wheels.sh fetches pydantic and
# the server's; fla-core for the kernels comparison is fetched by hand).
set -uo pipefail
OUT="${OUT:-out}"; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONUNBUFFERED=1
python3 - <<'PY' | tee "$OUT/env.txt"
import torch, triton, platform
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__)
for i in range(torch.cuda.device_count()):
    print(f"cuda:{i}", torch.cuda.get_device_name(i))
PY
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/env.txt"
dflash() { python3 -m dflash.cli "$@"; }
# a prompt in the default pair's domain (Python source): a random one is noise to it
DEFAULT_PROMPT=$'import os\nimport sys\n\n\ndef main(argv):\n    """Parse the command line and run."""\n    parser = argparse.ArgumentParser('
for phase in "$@"; do
  case "$phase" in
    tests)
      python3 -m pytest tests/gpu -q -s -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
      ;;
    fp8)
      [ "${FP8_TESTS:-1}" = 1 ] && python3 -m pytest tests/gpu/test_fp8_linear_gpu.py -q -s \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_fp8.log" | tail -8
      # FP8_FORMS: the kernel forms to bench ("default" = x_major,bits, "none", "x_major",
      # "bits"; each run sets DFLASH_FP8_FORM)
      for form in ${FP8_FORMS:-default}; do
        for shape in ${FP8_SHAPES:-nine-b-shape twenty-seven-b-shape}; do
          name=bench_${FP8_QUANT:-fp8}_${shape}_${form/,/_}
          env_form=$form; [ "$form" = default ] && env_form=
          DFLASH_FP8_FORM=$env_form timeout "${BENCH_TIMEOUT:-600}" python3 -m dflash.cli bench \
            --model "$shape" --quantize "${FP8_QUANT:-fp8}" --draft synthetic --acceptance 0.874 \
            --block-size 16 --prompt-len 1024 --max-new-tokens 256 --a replay --b checkpoint \
            --warmup 1 --runs "${FP8_RUNS:-3}" --out "$OUT/$name.json" --plot '' 2>&1 \
            | tee "$OUT/$name.log" | tail -6
        done
      done
      ;;
    serve)
      for clients in 1 8; do
        python3 benchmarks/serve_load.py --devices cuda:0 --clients "$clients" --requests 20 \
          --max-tokens 128 --json "$OUT/serve_load_h200_c$clients.json" 2>&1 \
          | tee "$OUT/serve_load_h200_c$clients.log"
      done
      ;;
    long)
      # LONG_TESTS=0 skips the tests; GDN=chunked|recurrent picks the GDN layers' prefill form,
      # GDN_CHUNK (16-128) and GDN_PRECISION (ieee|tf32) the chunked form's settings
      [ "${LONG_TESTS:-1}" = 1 ] && python3 -m pytest tests/gpu/test_prefill_attention_gpu.py \
        tests/gpu/test_gdn_chunk_gpu.py tests/gpu/test_long_context_gpu.py -q -s \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_long.log" | tail -15
      # (unset: the device's, 32 and tf32 on CUDA)
      name=long_context_9b_${GDN:-auto}_c${GDN_CHUNK:-default}_${GDN_PRECISION:-default}
      timeout "${LONG_TIMEOUT:-420}" python3 benchmarks/long_context.py --model nine-b-shape \
        --devices cuda:0 --lengths "${LENGTHS:-8192,16384,32768,65536,131072,262144}" \
        --chunk "${CHUNK:-4096}" --gdn "${GDN:-auto}" ${GDN_CHUNK:+--gdn-chunk "$GDN_CHUNK"} \
        ${GDN_PRECISION:+--gdn-precision "$GDN_PRECISION"} ${PROFILE:+--profile "$PROFILE"} \
        --out "$OUT/$name.json" 2>&1 | tee "$OUT/$name.log" | grep -v '^ *["{}]\|^ *\]'
      ;;
    bench)
      timeout "${BENCH_TIMEOUT:-600}" python3 -m dflash.cli bench --model nine-b-shape --draft synthetic --acceptance 0.874 --block-size 16 \
        --prompt-len 1024 --max-new-tokens 256 --a replay --b checkpoint,remap \
        --warmup 1 --runs 3 --out "$OUT/bench_9b.json" --plot "$OUT/bench_9b.png" \
        2>&1 | tee "$OUT/bench_9b.log"
      ;;
    bench-ab)
      # before / after / before on one machine, same command: DIR/dflash shadows this tree's
      for side in ${ORDER:-before after before2}; do
        path=$PYTHONPATH; [ "${side#after}" = "$side" ] && path=${BEFORE:?BEFORE=DIR}:$PYTHONPATH
        PYTHONPATH=$path timeout "${BENCH_TIMEOUT:-300}" python3 -m dflash.cli bench \
          --model nine-b-shape --draft synthetic --acceptance 0.874 --block-size 16 \
          --prompt-len 1024 --max-new-tokens 256 --a replay --b checkpoint,remap \
          --warmup 1 --runs 3 --out "$OUT/bench_9b_$side.json" --plot '' \
          > "$OUT/bench_9b_$side.log" 2>&1
        echo "$side rc=$?"; tail -12 "$OUT/bench_9b_$side.log"
      done
      ;;
    recompute)
      # model, block size, configurations B (A is checkpoint)
      for spec in "nine-b-shape 16 recompute,remap" "nine-b-shape 64 recompute" \
                  "twenty-seven-b-shape 16 recompute"; do
        set -- $spec
        name=bench_recompute_${1%%-*}_b$2
        timeout "${BENCH_TIMEOUT:-300}" python3 -m dflash.cli bench --model "$1" --draft synthetic \
          --acceptance 0.874 --block-size "$2" --prompt-len 1024 --max-new-tokens 256 \
          --a checkpoint --b "$3" --warmup 1 --runs 3 \
          --out "$OUT/$name.json" --plot '' > "$OUT/$name.log" 2>&1
        echo "$name rc=$?"; tail -8 "$OUT/$name.log"
      done
      ;;
    trees)
      # tree steps on the GPU (every mode) and the tree recompute kernels, then dflash bench
      # A/B/A checkpoint vs recompute with trees (and the chain at block 16, for reference)
      [ "${TREE_TESTS:-1}" = 1 ] && python3 -m pytest tests/gpu/test_trees.py \
        tests/gpu/test_kernels.py -q -s -p no:cacheprovider -k "tree or recompute" 2>&1 \
        | tee "$OUT/gpu_tests_trees.log" | tail -8
      # one tree step of 64 nodes against a chain step: wall and GPU ms, kernels by GPU time
      timeout 150 python3 benchmarks/profile_step.py --graphs-only --block 16 --tree 64 \
        --calls 8 --table --json "$OUT/profile_tree64.json" > "$OUT/profile_tree64.log" 2>&1
      echo "profile_tree64 rc=$?"; grep "forward\|spec step" "$OUT/profile_tree64.log"
      # TREE_SPECS: "model budget" pairs (budget 0: the chain), a subset when time is short
      IFS=';' read -r -a specs <<< "${TREE_SPECS:-nine-b-shape 64;nine-b-shape 16;twenty-seven-b-shape 64;nine-b-shape 0}"
      for spec in "${specs[@]}"; do
        set -- $spec
        name=bench_trees_${1%%-*}_t$2
        tree=(--tree-budget "$2"); [ "$2" = 0 ] && tree=()
        timeout "${BENCH_TIMEOUT:-300}" python3 -m dflash.cli bench --model "$1" --draft synthetic \
          --acceptance 0.874 --block-size 16 --prompt-len 1024 --max-new-tokens 256 \
          "${tree[@]}" --a checkpoint --b recompute --warmup 1 --runs 3 \
          --out "$OUT/$name.json" --plot '' > "$OUT/$name.log" 2>&1
        echo "$name rc=$?"; tail -8 "$OUT/$name.log"
      done
      ;;
    default-trees)
      # the default pair's main path with trees (the DFlash drafter drafting each tree's
      # candidates on the device) against its chain: dflash bench A/B/A, greedy, budgets
      # DEFAULT_BUDGETS (0: the chain); the default pair's tree tests first (parity, device
      # drafting; DEFAULT_TREE_TESTS=0: none)
      [ "${DEFAULT_TREE_TESTS:-1}" = 1 ] && python3 -m pytest tests/gpu/test_api.py -q -s \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_default_trees.log" | tail -8
      for budget in ${DEFAULT_BUDGETS:-0 16 32 64}; do
        name=bench_default_trees_t$budget
        tree=(--tree-budget "$budget"); [ "$budget" = 0 ] && tree=()
        timeout "${BENCH_TIMEOUT:-300}" python3 -m dflash.cli bench --model default \
          --prompt "$DEFAULT_PROMPT" --max-new-tokens 256 "${tree[@]}" \
          --a checkpoint --b recompute --warmup 1 --runs 3 --out "$OUT/$name.json" \
          --plot '' > "$OUT/$name.log" 2>&1
        echo "$name rc=$?"; tail -8 "$OUT/$name.log"
      done
      ;;
    sampling)
      # the rule's kernels and sampled steps on the GPU (every mode, chains, trees, coupled
      # device drafting), the rule's cost in a 9B verify step, then dflash bench: the 9B
      # shape (synthetic drafter) at temperature 0.7 and 0, the default pair at 0.7, 1.0, 0
      python3 -m pytest tests/gpu/test_sample_kernels.py tests/gpu/test_sampled.py -q -s \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_sampled.log" | tail -20
      timeout "${COST_TIMEOUT:-300}" python3 benchmarks/sampling_cost.py \
        --json "$OUT/sampling_cost.json" 2>&1 | tee "$OUT/sampling_cost.log" | tail -18
      for temp in ${NINE_TEMPS:-0.7 0}; do
        name=bench_sampled_nine_t$temp
        timeout "${BENCH_TIMEOUT:-300}" python3 -m dflash.cli bench --model nine-b-shape \
          --draft synthetic --acceptance 0.874 --block-size 16 --prompt-len 1024 \
          --max-new-tokens 256 --temperature "$temp" --seed 1 --a checkpoint --b recompute \
          --warmup 1 --runs 3 --out "$OUT/$name.json" --plot '' > "$OUT/$name.log" 2>&1
        echo "$name rc=$?"; tail -8 "$OUT/$name.log"
      done
      for temp in ${DEFAULT_TEMPS:-0.7 1.0 0}; do
        name=bench_sampled_default_t$temp
        # a prompt in the pair's domain (Python source): a random one is noise to it
        timeout "${BENCH_TIMEOUT:-300}" python3 -m dflash.cli bench --model default \
          --prompt "$DEFAULT_PROMPT" --max-new-tokens 256 --temperature "$temp" --seed 1 \
          --a checkpoint --b recompute --warmup 1 --runs 3 --out "$OUT/$name.json" \
          --plot '' > "$OUT/$name.log" 2>&1
        echo "$name rc=$?"; tail -8 "$OUT/$name.log"
      done
      ;;
    accept)
      # the acceptance inside CUDA graphs and top-p's mass launches: the rule's GPU tests
      # (every mode, chains and trees, the graphed acceptance, the oracle's graphed draws),
      # the mass launches' configurations, the rule's cost in a 9B verify step (interleaved,
      # COST_ROUNDS rounds, default 7), its kernels' profile
      python3 -m pytest tests/gpu/test_sample_kernels.py tests/gpu/test_sampled.py -q -s \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_accept.log" | tail -20
      timeout "${COST_TIMEOUT:-300}" python3 benchmarks/filter_mass.py \
        --json "$OUT/filter_mass.json" 2>&1 | tee "$OUT/filter_mass.log" | tail -16
      timeout "${COST_TIMEOUT:-300}" python3 benchmarks/sampling_cost.py \
        --rounds "${COST_ROUNDS:-7}" --json "$OUT/sampling_cost.json" 2>&1 \
        | tee "$OUT/sampling_cost.log" | tail -22
      timeout "${COST_TIMEOUT:-300}" python3 benchmarks/sampling_cost.py --profile \
        > "$OUT/sampling_profile.log" 2>&1; echo "profile rc=$?"
      ;;
    filters)
      # the filters' floors as a Triton histogram: the kernels' and sampled steps' GPU
      # tests, the rule's cost in a 9B verify step (and its kernels' profile), then dflash
      # bench with Qwen's recommended filters on the 9B shape and the default pair
      python3 -m pytest tests/gpu/test_sample_kernels.py tests/gpu/test_sampled.py -q -s \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests_filters.log" | tail -20
      timeout "${COST_TIMEOUT:-300}" python3 benchmarks/sampling_cost.py \
        --json "$OUT/sampling_cost.json" 2>&1 | tee "$OUT/sampling_cost.log" | tail -22
      timeout "${COST_TIMEOUT:-300}" python3 benchmarks/sampling_cost.py --profile \
        > "$OUT/sampling_profile.log" 2>&1; echo "profile rc=$?"
      # HEAD_SCALE=4: the same on a peaked distribution (a nucleus of a few hundred tokens)
      if [ -n "${HEAD_SCALE:-}" ]; then
        timeout "${COST_TIMEOUT:-300}" python3 benchmarks/sampling_cost.py \
          --head-scale "$HEAD_SCALE" --json "$OUT/sampling_cost_peaked.json" 2>&1 \
          | tee "$OUT/sampling_cost_peaked.log" | tail -12
      fi
      name=bench_filters_nine
      timeout "${BENCH_TIMEOUT:-300}" python3 -m dflash.cli bench --model nine-b-shape \
        --draft synthetic --acceptance 0.874 --block-size 16 --prompt-len 1024 \
        --max-new-tokens 256 --temperature 0.6 --top-k 20 --top-p 0.95 --seed 1 \
        --a checkpoint --b recompute --warmup 1 --runs 3 --out "$OUT/$name.json" \
        --plot '' > "$OUT/$name.log" 2>&1
      echo "$name rc=$?"; tail -8 "$OUT/$name.log"
      name=bench_filters_default
      timeout "${BENCH_TIMEOUT:-300}" python3 -m dflash.cli bench --model default \
        --prompt "$DEFAULT_PROMPT" --max-new-tokens 256 --temperature 0.6 --top-k 20 \
        --top-p 0.95 --seed 1 --a checkpoint --b recompute --warmup 1 --runs 3 \
        --out "$OUT/$name.json" --plot '' > "$OUT/$name.log" 2>&1
      echo "$name rc=$?"; tail -8 "$OUT/$name.log"
      ;;
    tiles)
      python3 -m pytest tests/gpu/test_minv_kernels.py tests/gpu/test_trees.py -q \
        -p no:cacheprovider -k "attention or tree" 2>&1 | tee "$OUT/gpu_tests_tiles.log" | tail -4
      timeout "${HOT_TIMEOUT:-420}" python3 benchmarks/hot_kernels.py --part tiles \
        --contexts "${TILE_CONTEXTS:-8192,131072}" --out "$OUT/hot_tiles.json" 2>&1 \
        | tee "$OUT/hot_tiles.log" | grep "attention tiles"
      ;;
    spec128k)
      # dflash bench at 131,072 tokens (9B, synthetic drafter at 0.874, block 16) over
      # TOKENS_128K new tokens (1024: the drafter's acceptance near its mean; 256 is a
      # sample of about 45 steps)
      name=bench_9b_128k_${TOKENS_128K:-1024}
      timeout "${BENCH_TIMEOUT:-300}" python3 -m dflash.cli bench --model nine-b-shape \
        --prompt-len 131072 --draft synthetic --acceptance 0.874 --block-size 16 \
        --max-new-tokens "${TOKENS_128K:-1024}" --a checkpoint --b remap --warmup 1 --runs 1 \
        --out "$OUT/$name.json" --plot '' > "$OUT/$name.log" 2>&1
      echo "$name rc=$?"; tail -10 "$OUT/$name.log"
      ;;
    tiles128k)
      for tiles in ${TILE_COUNTS:-1 4}; do
        name=bench_9b_128k_tiles$tiles
        DFLASH_ATTENTION_ROW_TILES=$tiles timeout "${BENCH_TIMEOUT:-300}" python3 -m dflash.cli \
          bench --model nine-b-shape --prompt-len 131072 --draft synthetic --acceptance 0.874 \
          --block-size 16 --max-new-tokens 256 --a checkpoint --b remap --warmup 1 --runs 1 \
          --out "$OUT/$name.json" --plot '' > "$OUT/$name.log" 2>&1
        echo "$name rc=$?"; tail -6 "$OUT/$name.log"
      done
      ;;
    glue)
      python3 -m pytest tests/gpu/test_fused_glue_gpu.py -q -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_tests_glue.log" | tail -3
      timeout "${GLUE_TIMEOUT:-200}" python3 benchmarks/forward_kernels.py --rows 1 16 64 \
        --json "$OUT/forward_kernels.json" > "$OUT/forward_kernels.log" 2>&1
      echo "forward_kernels rc=$?"; grep -v Warn "$OUT/forward_kernels.log" | head -90
      # a tree verify of 64 nodes: its GPU parts and the host's time to issue it
      timeout "${GLUE_TIMEOUT:-200}" python3 benchmarks/forward_kernels.py --rows 16 64 \
        --quantize none --tree --json "$OUT/forward_kernels_tree.json" \
        > "$OUT/forward_kernels_tree.log" 2>&1
      echo "forward_kernels --tree rc=$?"; grep "==" "$OUT/forward_kernels_tree.log"
      ;;
    hot)
      # decode attention, FP8 linear and GDN prefill against their floors, with sweeps
      timeout "${HOT_TIMEOUT:-420}" python3 benchmarks/hot_kernels.py \
        --part ${HOT_PARTS:-attention fp8 gdn} --out "$OUT/hot_kernels.json" 2>&1 \
        | tee "$OUT/hot_kernels.log" | grep -v '^ *["{}]\|^ *\]\|^ *[0-9.,-]*$'
      ;;
    fp8-shapes)
      # every 9B projection launch, fused groups and members, bf16 and FP8 against the
      # floor: the in-kernel split-K reduction on and off, then the fused shapes' sweep
      for f in 1 0; do
        echo "-- DFLASH_SPLIT_FIXUP=$f"
        (cd benchmarks && DFLASH_SPLIT_FIXUP=$f timeout 100 python3 fp8_shapes.py \
          --json "$OUT/fp8_shapes_fixup$f.json" 2>&1 | grep "M=1 ")
      done
      (cd benchmarks && timeout "${SWEEP_TIMEOUT:-200}" python3 fp8_shapes.py --sweep \
        --json "$OUT/fp8_shapes_sweep.json" 2>/dev/null | grep best)
      ;;
    wide)
      python3 -m pytest tests/gpu/test_minv_kernels.py -q -p no:cacheprovider 2>&1 \
        | tee "$OUT/wide_tests.log" | tail -5
      python3 benchmarks/linear_wide.py --out "$OUT/linear_wide.json" 2>&1 | tee "$OUT/linear_wide.log"
      # wide row tiles: bitwise equal to 16-row tiles? and their µs at 64 and 128 rows
      python3 benchmarks/wide_mma.py --trials 2 --out "$OUT/wide_mma.json" > "$OUT/wide_mma.log" 2>&1
      echo "wide_mma rc=$?"; tail -1 "$OUT/wide_mma.log"
      ;;
    kernels)
      python3 benchmarks/kernels.py --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
      ;;
    kernels-sweep)
      python3 benchmarks/kernels.py --sweep --out "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log"
      ;;
    cli)
      # the main command on two GPUs: 9B shape split 16+16, each drafter, parity checked
      mkdir -p /tmp/dflash_cli
      for run in dflash:remap prompt-lookup:checkpoint synthetic:checkpoint; do
        draft=${run%%:*}; mode=${run##*:}; json=/tmp/dflash_cli/${draft}_${mode}.json
        dflash generate --model nine-b-shape --draft "$draft" --acceptance 0.874 \
          --prompt-len 1024 --max-new-tokens 128 --rollback "$mode" \
          --devices cuda:0,cuda:1 --layer-split 16,16 --check-parity --json --no-progress \
          > "$json" 2>> "$OUT/cli_stderr.log"
        echo "rc=$? draft=$draft mode=$mode" | tee -a "$OUT/cli.log"
        python3 -c "import json,sys; d=json.load(open(sys.argv[1])); r=d['rollback']; \
print(' parity', d['parity'], 'sha', d['sha256'], 'status', r['status'], \
'fast/replay/fail', r['fast'], r['replay'], r['replay_after_failure'], \
'accept %.3f' % d['acceptance_rate'], 'tok/s %.1f' % d['timings']['tokens_per_s'])" \
          "$json" | tee -a "$OUT/cli.log"
      done
      ;;
    minv)
      python3 -m pytest tests/gpu/test_minv_kernels.py -q -p no:cacheprovider 2>&1 \
        | tee "$OUT/minv_tests.log"
      python3 benchmarks/minv_kernels.py --out "$OUT/minv_kernels.json" 2>&1 \
        | tee "$OUT/minv_kernels.log"
      ;;
    graphs)
      timeout "${GRAPHS_TIMEOUT:-600}" python3 -m pytest tests/gpu/test_graphs.py -q -s \
        -p no:cacheprovider --durations=0 2>&1 | tee "$OUT/graphs_tests.log"
      ;;
    profile)
      timeout "${PROFILE_TIMEOUT:-600}" python3 benchmarks/profile_step.py \
        --json "$OUT/profile_step.json" 2>&1 | tee "$OUT/profile_step.log"
      ;;
    parity)
      # every rollback mode against plain one-token-per-forward greedy, bitwise (--check-parity)
      for spec in "nine-b-shape synthetic 1024 128" "${PARITY_MODEL:-default} dflash 64 256" \
                  "${PARITY_MODEL:-default} prompt-lookup 64 256"; do
        set -- $spec
        for mode in replay checkpoint remap recompute; do
          dflash generate --model "$1" --draft "$2" --prompt-len "$3" --max-new-tokens "$4" \
            --rollback "$mode" --check-parity --json --no-progress \
            > /tmp/parity.json 2>> "$OUT/parity_stderr.log"
          echo "rc=$? model=$1 draft=$2 mode=$mode" | tee -a "$OUT/parity.log"
          python3 -c "import json; d=json.load(open('/tmp/parity.json')); r=d['rollback']; \
print(' parity', d['parity'], 'sha', d['sha256'][:16], 'status', r['status'], \
'fast/replay/fail', r['fast'], r['replay'], r['replay_after_failure'], \
'accept %.3f' % d['acceptance_rate'], 'commit %.2f' % d['avg_commit'])" | tee -a "$OUT/parity.log"
        done
      done
      ;;
    drafter)
      # needs the trained target in dflash/data/default/target (the recipe's target stage)
      python3 scripts/build_default.py --out /tmp/dflash_build --only-drafter \
        --target-dir dflash/data/default/target --work /tmp/dflash_build_work 2>&1 \
        | tee "$OUT/build_drafter.log"
      (cd /tmp/dflash_build && tar cf "$OUT/drafter.tar" drafter summary.json loss_curves.png)
      ;;
    drafter2)
      # a DFlash2 drafter for the default pair, the v1 recipe at a step count that fits one
      # 10-minute call: the DFlash2 step costs 148.7 ms at batch 128 against v1's 65.4
      # (benchmarks/train_step.py --formats dflash,dflash2); D2_STEPS, D2_SAMPLES override
      timeout "${D2_TIMEOUT:-560}" python3 scripts/build_default.py --out /tmp/dflash2_build \
        --only-drafter --target-dir dflash/data/default/target --work /tmp/dflash2_work \
        --drafter-extra "--format dflash2" --set drafter_steps="${D2_STEPS:-2400}" \
        --set drafter_teacher_samples="${D2_SAMPLES:-196608}" --set drafter_eval_every=1200 \
        --set drafter_save_every=0 2>&1 | tee "$OUT/build_drafter2.log" | tail -6
      (cd /tmp/dflash2_build && tar czf "$OUT/drafter2.tgz" drafter summary.json loss_curves.png)
      ;;
    *) echo "unknown phase $phase"; exit 2 ;;
  esac
done
