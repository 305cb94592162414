#!/bin/sh
# A toy "agent": reads the task in $1, writes its answer to $2. BusyBox sh: no bash, no python.
# Like a sampled policy it is imperfect, and its mistakes depend on the episode seed ($SEED):
# about one episode in three drops the last line of its answer. Same seed, same answer.
set -eu
task_dir=$1
answer=$2
mkdir -p "$(dirname "$answer")"
case "$(cat "$task_dir/task.txt")" in
    reverse) sed -n '1!G;h;$p' "$task_dir/input.txt" ;;
    upper) tr 'a-z' 'A-Z' < "$task_dir/input.txt" ;;
    sort) sort -n "$task_dir/input.txt" ;;
    *) echo "agent: unknown task" >&2; exit 2 ;;
esac > "$answer.tmp"
if [ $(( (SEED + $(wc -c < "$task_dir/input.txt")) % 3 )) -eq 0 ]; then
    sed '$d' "$answer.tmp" > "$answer"
else
    cp "$answer.tmp" "$answer"
fi
rm -f "$answer.tmp"
echo "agent: wrote $(wc -l < "$answer") line(s) for seed $SEED"
