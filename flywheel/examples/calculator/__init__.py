"""Calculator word-problem task: problems, tool, prompt, reward and SFT demonstrations."""

from flywheel.examples.calculator.task import (
    CALCULATOR_TOOL,
    LEVELS,
    SYSTEM_PROMPT,
    Problem,
    Split,
    calculator,
    demonstration,
    extract_answer,
    generate_problems,
    reward,
)

__all__ = [
    "CALCULATOR_TOOL",
    "LEVELS",
    "SYSTEM_PROMPT",
    "Problem",
    "Split",
    "calculator",
    "demonstration",
    "extract_answer",
    "generate_problems",
    "reward",
]
