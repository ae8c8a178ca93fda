set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
L=$OUT/log.txt; C=$(cat .commit)
bash scripts/ab_trees.sh .ab/old x 0 > $L 2>&1
PIP_NO_INDEX=1 PIP_FIND_LINKS=$PWD/.whl python3 -m pip install -q -e '.[test]' >> $L 2>&1; echo "install rc=$?" >> $L
timeout 110 python3 bench/bench_moe.py --timing graph --shapes qwen3-30b-a3b --tokens 1024,4096,16384 --iters 20 --out $OUT --commit $C > $OUT/bench.txt 2>&1
timeout 110 python3 bench/bench_moe.py --timing graph --shapes deepseek-v3,deepseek-v3-ep8-slice --tokens 8192 --iters 20 --out $OUT --commit $C >> $OUT/bench.txt 2>&1
for T in 2048 16384; do timeout 30 python3 bench/host_profile.py --tokens $T --steps 40; done >> $L 2>&1
timeout 250 python3 -m pytest -q -p no:cacheprovider -rs > $OUT/pytest.txt 2>&1; echo "pytest rc=$?" >> $OUT/pytest.txt
grep -E "bitwise|DIFFERS|mok_rt from|install|host enqueue" $L | head; grep -E "passed|failed|rc=|^FAILED|^ERROR|GPU tests" $OUT/pytest.txt | tail -8; grep -E "^(qwen|deepseek)|error|capture" $OUT/bench.txt | tail -12
