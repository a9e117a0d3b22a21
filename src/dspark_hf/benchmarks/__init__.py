"""`dspark-hf bench`: side-by-side benchmarks of speculative decoding methods (see `benchmarks/README.md`)."""

from .bench import BenchSettings, conversation_record, main, run_benchmark, run_conversation
from .methods import BenchMethod, build_methods, load_steps_per_second, measure_generation, rounds_from_forward_calls
from .prompts import BenchPrompt, load_prompts, read_prompt_file, render_conversation
from .report import acceptance_by_position, summarize_records, write_report


__all__ = [
    "BenchMethod",
    "BenchPrompt",
    "BenchSettings",
    "acceptance_by_position",
    "build_methods",
    "conversation_record",
    "load_prompts",
    "load_steps_per_second",
    "main",
    "measure_generation",
    "read_prompt_file",
    "render_conversation",
    "rounds_from_forward_calls",
    "run_benchmark",
    "run_conversation",
    "summarize_records",
    "write_report",
]
