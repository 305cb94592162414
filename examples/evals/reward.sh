#!/bin/sh
# The reward function, run inside the guest after the agent is done: the fraction of expected
# lines the answer has at the same position, printed as a number in [0, 1].
set -eu
expected=$1
answer=$2
[ -f "$answer" ] || { echo 0; exit 0; }
awk 'NR == FNR { want[FNR] = $0; n = FNR; next }
     (FNR in want) && $0 == want[FNR] { ok++ }
     END { printf "%.4f\n", (n ? ok / n : 0) }' "$expected" "$answer"
