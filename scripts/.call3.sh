set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
L=$OUT/log.txt
PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl python3 -m pip install -q -e '.[test]' > $L 2>&1; echo "install rc=$?" >> $L
timeout 250 python3 -m pytest -q -p no:cacheprovider -rs tests/test_graphs_gpu.py tests/test_layer_gpu.py tests/test_moe_tma_gpu.py tests/test_ep_gpu.py tests/test_trace_gpu.py > $OUT/pytest.txt 2>&1; echo "pytest rc=$?" >> $OUT/pytest.txt
(cd /tmp && timeout 60 python3 $OLDPWD/samples/train_moe_ep.py --one-process --ranks-per-gpu 2 --steps 4 --tokens 2048) >> $L 2>&1
for T in 1024 2048 16384; do timeout 40 python3 bench/host_profile.py --tokens $T --steps 40; done >> $L 2>&1
timeout 40 python3 bench/host_profile.py --tokens 2048 --steps 10 --profile 2>&1 | head -60 >> $L
timeout 200 python3 bench/bench_moe.py --timing graph --shapes qwen3-30b-a3b --tokens 1024,4096 --iters 20 --out $OUT/b --commit wip > $OUT/bench.txt 2>&1
grep -E "passed|failed|rc=|^FAILED|^ERROR" $OUT/pytest.txt | tail -12; grep -E "install|host enqueue|done|Error|error" $L | tail -12; tail -4 $OUT/bench.txt
