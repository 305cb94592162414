"""A small Inspect task whose tool and scorer run in ``smolvm`` guests, driven by Inspect's mock model.

``inspect eval tests/inspect_eval/squares.py`` runs it as a user would (tests/test_inspect_eval.py):
the mock model asks for one tool call per sample, the tool runs in the sample's guest, and the
scorer reads what it wrote from that same guest. The last sample's target is wrong on purpose,
so the accuracy (0.75) shows that the scorer really looked.
"""

from __future__ import annotations

from inspect_ai import Task, task
from inspect_ai.dataset import Sample
from inspect_ai.model import ChatMessage, ChatMessageTool, GenerateConfig, ModelOutput, ModelUsage, get_model
from inspect_ai.scorer import CORRECT, INCORRECT, Score, Scorer, Target, accuracy, scorer
from inspect_ai.solver import TaskState, generate, use_tools
from inspect_ai.tool import Tool, ToolChoice, ToolInfo, tool
from inspect_ai.util import sandbox

NUMBERS = (2, 3, 4, 5)
WRONG = 5  # this sample's target is not its square


@tool
def shell() -> Tool:
    async def execute(cmd: str) -> str:
        """Run a shell command in the sample's guest.

        Args:
            cmd: the command line
        """
        result = await sandbox().exec(["sh", "-c", cmd])
        return result.stdout + result.stderr

    return execute


def policy(messages: list[ChatMessage], tools: list[ToolInfo], choice: ToolChoice,
           config: GenerateConfig) -> ModelOutput:
    """The mock model: one tool call that writes the square of the prompt's number, then an answer."""
    if isinstance(messages[-1], ChatMessageTool):
        output = ModelOutput.from_content("mockllm/model", "done")
    else:
        n = int(messages[-1].text)
        # The sleep keeps the samples' guests alive together: the eval runs them at once.
        output = ModelOutput.for_tool_call("mockllm/model", "shell",
                                           {"cmd": f"sleep 1; echo $(({n} * {n})) > answer-{n}.txt"})
    # Usage given, or mockllm counts tokens with a tokenizer it downloads (no network in CI).
    output.usage = ModelUsage(input_tokens=1, output_tokens=1, total_tokens=2)
    return output


@scorer(metrics=[accuracy()])
def in_guest() -> Scorer:
    async def score(state: TaskState, target: Target) -> Score:
        # A fresh guest per sample: this sample's answer is the only file in the working dir,
        # and the configured (non-root) user wrote it.
        listing = await sandbox().exec(["sh", "-c", "ls; stat -c %U answer-*.txt; cat answer-*.txt"])
        ok = listing.stdout.split() == [f"answer-{state.input_text}.txt", "agent", target.text]
        return Score(value=CORRECT if ok else INCORRECT, explanation=listing.stdout + listing.stderr)

    return score


@task
def squares(config: str = "smolvm.toml") -> Task:
    targets = {n: n * n + (n == WRONG) for n in NUMBERS}
    return Task(
        dataset=[Sample(input=str(n), target=str(t)) for n, t in targets.items()],
        solver=[use_tools(shell()), generate()],
        scorer=in_guest(),
        sandbox=("smolvm", config),
        model=get_model("mockllm/model", custom_outputs=policy),
    )
