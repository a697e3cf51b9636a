#!/bin/bash
# issue 21 timing window on the AMD host: run alone (nothing else heavy on the machine).
# Prerequisites of the perf step (made before the window, not timed):
#   cmake -S . -B /tmp/profbuild -G Ninja -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_FLAGS=-g -DCMAKE_CXX_FLAGS=-g \
#         -DKVFLASH_PYTHON=OFF -DKVFLASH_TESTS=OFF && cmake --build /tmp/profbuild --target kvflash   # not stripped
#   gcc -O2 -Icsrc/kvflash examples/c/generate.c -L/tmp/profbuild -lkvflash -Wl,-rpath,/tmp/profbuild \
#       -o /tmp/rr/kvflash_generate
#   python -c "import kvflash; from kvflash.bench.common import text_tokens; \
#     s = kvflash.Session('smollm2-135m', max_ctx=4096, kvflash=2048, verbose=False); \
#     print(' '.join(map(str, text_tokens(s, 2000))))" > /tmp/rr/ids2000.txt
cd /work/main; . /work/venv/bin/activate
M=$HOME/.cache/kvflash/models/SmolLM2-135M-Instruct.Q4_1.gguf
LB=/work/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-bench
O=bench/results/decode-depth-amd; mkdir -p $O
exec > >(tee $O/run.log) 2>&1
date; echo "== attention op alone (bench/results/attention-amd)"
python -m kvflash.bench attention --preset standard --kv-types q8_0,q4_0 --out bench/results/attention-amd
date; echo "== kvflash decode, 256 and 2K (pool 2048)"
python bench/ab_builds.py --build head=/work/venv/bin/python --build head-again=/work/venv/bin/python --contexts 256,2048 --pool 2048 --rounds 7 --steps 32 --threads 2 --floor --json $O/ab-short.json
date; echo "== decode_overhead at 256 (right after ab_builds: the two harnesses' gap)"
python bench/decode_overhead.py --model smollm2-135m --threads 2 --context 256 --steps 64 --rounds 7 --json $O/overhead-256.json
date; echo "== decode_overhead at 2048 (pool full)"
python bench/decode_overhead.py --model smollm2-135m --threads 2 --context 2048 --steps 64 --rounds 7 --json $O/overhead-2048.json
date; echo "== kvflash decode, 16K and 32K (pool 2048)"
python bench/ab_builds.py --build head=/work/venv/bin/python --build head-again=/work/venv/bin/python --contexts 16384,32768 --pool 2048 --rounds 5 --steps 32 --threads 2 --floor --json $O/ab-long.json
date; echo "== llama-bench d0 and d16384"
$LB -m $M -t 2 -n 64 -p 0 -d 0,16384 -r 5 --repack 0 -fa 1 -ctk q8_0 -ctv q8_0
date; echo "== perf profile of decode with the 2K pool full (C example, unstripped libkvflash built with -g)"
G=/tmp/rr/kvflash_generate
t0=$(date +%s.%N); $G $M --pool 2048 --max-ctx 4096 -t 2 -n 1 --ids-file /tmp/rr/ids2000.txt > /dev/null; t1=$(date +%s.%N)
D=$(python -c "print(int(1000*($t1-$t0))+1500)"); echo "load+prefill $(python -c "print(round($t1-$t0,2))") s; perf delay $D ms"
perf record -e cpu-clock -F 1999 -D $D -o /tmp/rr/perf.data -- $G $M --pool 2048 --max-ctx 4096 -t 2 -n 1500 --ids-file /tmp/rr/ids2000.txt | tail -1
perf report -i /tmp/rr/perf.data --stdio --no-children --sort dso,symbol --percent-limit 0.4 2>/dev/null | grep -v "^#" | grep -v "^$" | head -40
echo "-- source lines of the attention kernel (share of all samples)"
timeout 300 perf report -i /tmp/rr/perf.data --stdio --no-children --sort sym,srcline --percent-limit 0.7 2>/dev/null | grep -v "^#" | grep -v "^$" | grep -i "attn\|pool_att" | head -40
date; echo done
