"""Publishing drafters: model cards, a `custom_generate` recipe, and `push_to_hub`.

A published drafter repository holds:

- ``config.json`` + safetensors in the official DeepSpec layout (checked with [`interop.check_checkpoint`]), so
  DeepSpec, vLLM and SGLang load it as they load ``deepseek-ai/dspark_*``;
- ``README.md``: a model card (metadata for the Hub, usage for transformers and vLLM, the training recipe and the
  benchmark table), rendered from ``templates/model_card.md`` with `huggingface_hub.ModelCard`;
- ``custom_generate/generate.py`` + ``requirements.txt``: DSpark decoding for users without dspark-hf, through
  ``target.generate(..., custom_generate="org/drafter", trust_remote_code=True)``. It is written from
  ``templates/custom_generate/generate.py`` with the policy interface and drafting modules every DSpark path runs
  (`dspark_hf.generation.verification_policy`, `dspark_hf.generation.drafting`) and its stopping check
  (`dspark_hf.generation.stopping`) inlined in place of its imports
  ([`custom_generate_source`]), so the recipe cannot drift from dspark-hf's own drafting and still runs without it.

Entry points: [`render_model_card`] (offline), [`save_drafter`] (a ready-to-upload folder), [`push_drafter`] and the
``dspark-hf push`` command ([`main`]).
"""

from __future__ import annotations

import ast
import copy
import inspect
import json
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from huggingface_hub import HfApi, ModelCard, ModelCardData
from transformers import PreTrainedConfig, PreTrainedModel
from transformers.utils import logging

from . import interop, registry
from .generation import drafting, stopping, verification_policy


logger = logging.get_logger(__name__)

TEMPLATES = Path(__file__).parent / "templates"
MODEL_CARD_TEMPLATE = TEMPLATES / "model_card.md"
CUSTOM_GENERATE_TEMPLATE = TEMPLATES / "custom_generate"
DRAFTER_PLACEHOLDER = '"__DSPARK_DRAFTER__"'
DEFAULT_TAGS = ("dspark", "speculative-decoding", "draft-model", "custom_generate")


# --- model card -------------------------------------------------------------------------------------------------------


def build_card_data(
    card_data: ModelCardData | Mapping[str, Any] | None = None, *, training: Mapping[str, Any] | None = None
) -> ModelCardData:
    """The card's metadata: the given fields plus DSpark defaults; raises if a required field is missing.

    Defaults: ``library_name="transformers"``, ``pipeline_tag="text-generation"``, the DSpark tags, and ``datasets``
    from ``training["datasets"]``. ``base_model`` (the target's Hub id) and ``license`` must be given: the drafter
    is trained for one target and carries copies of its embedding and LM head, so it inherits the target's license.
    """
    values = card_data.to_dict() if isinstance(card_data, ModelCardData) else dict(card_data or {})
    values.setdefault("library_name", "transformers")
    values.setdefault("pipeline_tag", "text-generation")
    values["tags"] = list(dict.fromkeys([*DEFAULT_TAGS, *(values.get("tags") or [])]))
    if not values.get("datasets") and training and training.get("datasets"):
        values["datasets"] = list(training["datasets"])
    missing = [key for key in ("base_model", "license") if not values.get(key)]
    if missing:
        raise ValueError(
            f"The model card needs {missing}: pass base_model='<target Hub id>' (e.g. 'Qwen/Qwen3-4B') and "
            "license='<the target's license>' (e.g. 'apache-2.0'); the drafter holds copies of the target's "
            "embedding and LM head."
        )
    return ModelCardData(**values)


def render_model_card(
    drafter: PreTrainedModel | PreTrainedConfig,
    *,
    repo_id: str,
    card_data: ModelCardData | Mapping[str, Any] | None = None,
    benchmark: Any = None,
    training: Mapping[str, Any] | str | Path | None = None,
    template_path: str | Path = MODEL_CARD_TEMPLATE,
) -> ModelCard:
    """Renders the drafter's model card (no network access).

    Args:
        drafter ([`DSparkDrafter`] or its config): what the card describes.
        repo_id (`str`): where the drafter is (or will be) published, used in the usage snippets.
        card_data ([`ModelCardData`] or `dict`): metadata; needs ``base_model`` and ``license`` (see
            [`build_card_data`]), may add ``tags``, ``datasets``, ``language``, ``model_name``.
        benchmark: rows as a list of dicts, or ``{"rows": [...], "machine": ..., "versions": ..., "command": ...}``
            (as written by ``dspark-hf bench``; an optional ``"notes"`` string is printed under the table, e.g. what
            a column means), or a path to such a JSON file.
        training: the training recipe as a dict (``datasets``, ``responses``, ``epochs``, ...) or a JSON path.

    Example:

    ```python
    >>> card = render_model_card(drafter, repo_id="me/dspark-qwen3-4b",
    ...                          card_data={"base_model": "Qwen/Qwen3-4B", "license": "apache-2.0"})  # doctest: +SKIP
    >>> card.save("README.md")  # doctest: +SKIP
    ```
    """
    training = _load_json(training)
    data = build_card_data(card_data, training=training)
    config = drafter if isinstance(drafter, PreTrainedConfig) else drafter.config
    fields = _model_fields(config)
    num_parameters = None if isinstance(drafter, PreTrainedConfig) else sum(p.numel() for p in drafter.parameters())
    return ModelCard.from_template(
        data,
        template_path=str(template_path),
        model_name=data.model_name or repo_id.split("/")[-1],
        repo_id=repo_id,
        base_model=data.base_model if isinstance(data.base_model, str) else data.base_model[0],
        num_parameters=_format_count(num_parameters),
        training=format_training(training),
        benchmark=format_benchmark(_load_json(benchmark)),
        dspark_hf_version=_package_version(),
        **fields,
    )


def _model_fields(config: PreTrainedConfig) -> dict[str, Any]:
    """Template fields describing the drafter, read from its config in the official layout."""
    config_dict = config.to_dict()
    markov = "none (DFlash-style drafter)"
    if config.markov_rank:
        markov = f"{config.markov_head_type}, rank {config.markov_rank}"
    confidence = "none"
    if config.enable_confidence_head:
        calibrated = "calibrated (Sequential Temperature Scaling)" if config.confidence_temperatures else "uncalibrated"
        with_markov = " + previous-token Markov embedding" if config.confidence_head_with_markov else ""
        confidence = f"sigmoid(linear(h_k{with_markov})), {calibrated}"
    architecture = config_dict["architectures"][0]
    return {
        "architecture": architecture,
        "model_type": config_dict["model_type"],
        "drafter_class": registry.drafter_class_name(architecture),
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "block_size": config.block_size,
        "target_layer_ids": list(config.target_layer_ids),
        "num_target_layers": config.num_target_layers if config.num_target_layers is not None else "?",
        "markov_head": markov,
        "confidence_head": confidence,
        "mask_token_id": config.mask_token_id,
        "draft_vocabulary": (f"{config.draft_vocab_size} of {config.vocab_size} ids (`d2t` / `t2d`)"
                             if config.draft_vocab_size else f"the whole vocabulary ({config.vocab_size} ids)"),
        "dtype": str(config_dict.get("dtype") or "float32"),
    }


def format_training(training: Mapping[str, Any] | None) -> str:
    """The training recipe as a Markdown list (``key: value``), in the given order."""
    if not training:
        return "The training recipe was not recorded for this drafter."
    lines = []
    for key, value in training.items():
        if isinstance(value, (list, tuple)):
            value = ", ".join(f"`{item}`" if key == "datasets" else str(item) for item in value)
        lines.append(f"- **{key.replace('_', ' ')}**: {value}")
    return "\n".join(lines)


def format_benchmark(benchmark: Any) -> str:
    """A benchmark as a Markdown table (one row per dict, columns in first-seen order), its notes, and its
    provenance."""
    if not benchmark:
        return "No benchmark was recorded for this drafter."
    rows = (benchmark.get("rows") or benchmark.get("results")) if isinstance(benchmark, Mapping) else benchmark
    if not isinstance(rows, Sequence) or not all(isinstance(row, Mapping) for row in rows):
        raise ValueError(
            f"benchmark must be a list of dicts or a dict with 'rows' (a list of dicts); got {type(rows).__name__}."
        )
    columns = list(dict.fromkeys(key for row in rows for key in row))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(column)) for column in columns) + " |" for row in rows]
    if isinstance(benchmark, Mapping):
        if benchmark.get("notes"):
            lines.append(f"\n{benchmark['notes']}")
        for key in ("machine", "versions", "command"):
            if benchmark.get(key):
                value = benchmark[key]
                text = ", ".join(f"{k} {v}" for k, v in value.items()) if isinstance(value, Mapping) else value
                lines.append(f"\n{key.capitalize()}: `{text}`")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value).replace("|", "\\|")


def _format_count(count: int | None) -> str:
    if count is None:
        return "see the safetensors files"
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.1f} M" if count >= 1e6 else f"{count:,}"


def _load_json(value: Any) -> Any:
    if isinstance(value, (str, Path)):
        return json.loads(Path(value).read_text())
    return value


def _package_version() -> str:
    from . import __version__

    return __version__


# --- folders and uploads ----------------------------------------------------------------------------------------------


def write_custom_generate(save_directory: str | Path, drafter_reference: str) -> Path:
    """Writes ``custom_generate/generate.py`` ([`custom_generate_source`]) and ``requirements.txt`` into
    `save_directory`.

    Args:
        drafter_reference (`str`): the Hub id (or local folder) the recipe loads the drafter from by default, i.e. the
            repository it is pushed to.
    """
    folder = Path(save_directory) / "custom_generate"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generate.py").write_text(custom_generate_source(drafter_reference))
    (folder / "requirements.txt").write_text((CUSTOM_GENERATE_TEMPLATE / "requirements.txt").read_text())
    return folder


# The modules the custom_generate recipe runs, inlined into it in this order (each imports only the standard library,
# torch and transformers).
INLINED_MODULES = (verification_policy, drafting, stopping)


def custom_generate_source(drafter_reference: str | None = None) -> str:
    """The recipe's ``generate.py``: the template with the source of `INLINED_MODULES` in place of its imports of them
    (so it runs where dspark-hf is not installed), and ``DRAFTER`` set to `drafter_reference` (left as the placeholder
    when `None`: the caller passes ``dspark_drafter=``)."""
    template = (CUSTOM_GENERATE_TEMPLATE / "generate.py").read_text()
    if template.count(DRAFTER_PLACEHOLDER) != 1:
        raise RuntimeError(f"The custom_generate template must contain {DRAFTER_PLACEHOLDER} exactly once.")
    source = template
    for module in INLINED_MODULES:
        source = _inline_module(source, module)
    if drafter_reference is None:
        return source
    return source.replace(DRAFTER_PLACEHOLDER, json.dumps(str(drafter_reference)))


def _inline_module(source: str, module) -> str:
    """`source` with its one ``from <module> import ...`` statement replaced by the module's code (less its docstring
    and ``from __future__`` import). Refuses a module that imports dspark-hf itself or lacks an imported name."""
    statements = [node for node in ast.parse(source).body
                  if isinstance(node, ast.ImportFrom) and node.module == module.__name__]
    if len(statements) != 1:
        raise RuntimeError(f"The custom_generate template must import from {module.__name__} in exactly one statement.")
    module_source = inspect.getsource(module)
    tree = ast.parse(module_source)
    for node in ast.walk(tree):
        names = [node.module or ""] if isinstance(node, ast.ImportFrom) else []
        names += [alias.name for alias in node.names] if isinstance(node, ast.Import) else []
        if getattr(node, "level", 0) or any(name.split(".")[0] == "dspark_hf" for name in names):
            raise RuntimeError(f"{module.__name__} is inlined into the custom_generate recipe, which runs without "
                               f"dspark-hf; it must not import dspark-hf (line {node.lineno}).")
    defined = {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}
    missing = sorted({alias.name for alias in statements[0].names} - defined)
    if missing:
        raise RuntimeError(f"The custom_generate template imports {missing}, which {module.__name__} does not define.")
    # Skip the module's docstring and `from __future__` import: the template has its own, which must come first.
    preamble = [node for node in tree.body[:2] if isinstance(node, ast.Expr) or
                (isinstance(node, ast.ImportFrom) and node.module == "__future__")]
    code = module_source.splitlines()[preamble[-1].end_lineno if preamble else 0:]
    path = "/".join(module.__name__.split("."))
    lines = source.splitlines()
    start, end = statements[0].lineno - 1, statements[0].end_lineno
    inlined = [f"# --- {path}.py, inlined by dspark_hf.hub (edit it there) ---", *code, "",
               f"# --- end of {path}.py ---"]
    return "\n".join(lines[:start] + inlined + lines[end:]) + "\n"


def save_drafter(
    drafter: PreTrainedModel,
    save_directory: str | Path,
    *,
    repo_id: str,
    card_data: ModelCardData | Mapping[str, Any] | None = None,
    benchmark: Any = None,
    training: Mapping[str, Any] | str | Path | None = None,
    dtype: torch.dtype | None = None,
    check: bool = True,
) -> Path:
    """Writes everything a published drafter repository holds into `save_directory` (no network access).

    Args:
        drafter ([`DSparkDrafter`]): the drafter (a PEFT-wrapped one must be merged first).
        repo_id (`str`): the repository it is meant for (card snippets, the recipe's default drafter).
        card_data / benchmark / training: see [`render_model_card`].
        dtype (`torch.dtype`, *optional*): save in this dtype (the official releases are `torch.bfloat16`) without
            changing `drafter` itself.
        check (`bool`): refuse to write a folder that departs from the official layout ([`interop.assert_conforms`]).

    Returns:
        `Path`: the folder.
    """
    folder = Path(save_directory)
    card = render_model_card(drafter, repo_id=repo_id, card_data=card_data, benchmark=benchmark, training=training)
    if dtype is not None and drafter.dtype != dtype:
        drafter = copy.deepcopy(drafter).to(dtype)
    drafter.save_pretrained(folder)
    if check:
        interop.assert_conforms(folder)
    card.save(folder / "README.md")
    write_custom_generate(folder, repo_id)
    return folder


def push_drafter(
    drafter: PreTrainedModel,
    repo_id: str,
    *,
    card_data: ModelCardData | Mapping[str, Any] | None = None,
    benchmark: Any = None,
    training: Mapping[str, Any] | str | Path | None = None,
    private: bool | None = None,
    token: str | None = None,
    dtype: torch.dtype | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    commit_message: str = "Upload DSpark drafter",
):
    """Creates (if needed) the Hub repository `repo_id` and uploads the drafter, its model card and the
    ``custom_generate`` recipe in one commit.

    Args:
        drafter ([`DSparkDrafter`]): the drafter to publish.
        repo_id (`str`): ``"org/name"``.
        card_data / benchmark / training / dtype: see [`save_drafter`] and [`render_model_card`].
        private (`bool`, *optional*): visibility of a newly created repository.
        token (`str`, *optional*): a Hub token; defaults to the logged-in one.

    Returns:
        The `huggingface_hub.CommitInfo` of the upload.

    Example:

    ```python
    >>> push_drafter(drafter, "me/dspark-qwen3-4b", card_data={"base_model": "Qwen/Qwen3-4B",
    ...              "license": "apache-2.0"}, dtype=torch.bfloat16, private=True)  # doctest: +SKIP
    ```
    """
    api = HfApi(token=token)
    with tempfile.TemporaryDirectory(prefix="dspark-push-") as staging:
        # Render and check before touching the Hub: a bad card or layout fails without creating anything.
        save_drafter(drafter, staging, repo_id=repo_id, card_data=card_data, benchmark=benchmark, training=training,
                     dtype=dtype)  # fmt: skip
        api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
        return api.upload_folder(
            repo_id=repo_id,
            folder_path=staging,
            repo_type="model",
            commit_message=commit_message,
            revision=revision,
            create_pr=create_pr,
        )


def load_drafter(name_or_path: str, target: PreTrainedModel | None = None, **kwargs) -> PreTrainedModel:
    """Loads a drafter of either layout (``Qwen3DSparkModel`` or ``Gemma4DSparkModel``) from a folder or Hub id.

    Args:
        target ([`PreTrainedModel`], *optional*): binds its embedding and LM head into a compact checkpoint (one saved
            by [`DSparkDrafter.save_compact`] without them); unused for a checkpoint that has them.
    """
    config_dict, _ = PreTrainedConfig.get_config_dict(name_or_path, **kwargs)
    family = registry.drafter_family(config_dict)  # raises for a config that is not a DSpark drafter's
    drafter_class = registry.drafter_class(registry.architectures_of(family)[0])
    return drafter_class.from_pretrained(name_or_path, target=target, **kwargs)


# --- command line -----------------------------------------------------------------------------------------------------


@dataclass
class PushArguments:
    drafter: str = field(metadata={"help": "Folder (or Hub id) of the trained drafter, as written by save_pretrained."})
    repo_id: str = field(metadata={"help": "Destination Hub repository, 'org/name'."})
    base_model: str = field(metadata={"help": "Hub id of the target the drafter serves, e.g. 'Qwen/Qwen3-4B'."})
    license: str = field(metadata={"help": "License of the drafter (usually the target's), e.g. 'apache-2.0'."})
    benchmark: str | None = field(default=None, metadata={"help": "JSON from `dspark-hf bench` for the card's table."})
    training: str | None = field(default=None, metadata={"help": "JSON file describing the training recipe."})
    tags: list[str] = field(default_factory=list, metadata={"help": "Extra Hub tags."})
    datasets: list[str] = field(default_factory=list, metadata={"help": "Hub ids of the training datasets."})
    dtype: str = field(default="bfloat16", metadata={"help": "Dtype of the uploaded weights ('none' keeps them)."})
    private: bool = field(default=False, metadata={"help": "Create the repository as private."})
    token: str | None = field(default=None, metadata={"help": "Hub token (defaults to the logged-in one)."})
    target: str | None = field(
        default=None,
        metadata={"help": "Target (folder, Hub id or embedded name) whose embedding and LM head a compact drafter "
                          "(saved without them) binds; the pushed checkpoint then holds them, as the official layout "
                          "requires."},
    )  # fmt: skip
    output_dir: str | None = field(
        default=None, metadata={"help": "Write the repository folder here instead of uploading it (a dry run)."}
    )


def main(argv: list[str] | None = None) -> int:
    """``dspark-hf push``: publish a drafter with its model card and custom_generate recipe."""
    from .cli import dataclass_parser

    parser = dataclass_parser(PushArguments, "push", description=main.__doc__)
    (args,) = parser.parse_args_into_dataclasses(args=list(sys.argv[1:] if argv is None else argv))
    dtype = None if args.dtype.lower() == "none" else getattr(torch, args.dtype)
    card_data = {"base_model": args.base_model, "license": args.license, "tags": args.tags}
    if args.datasets:
        card_data["datasets"] = args.datasets
    drafter = _load_drafter_to_push(args.drafter, args.target)
    options = dict(card_data=card_data, benchmark=args.benchmark, training=args.training, dtype=dtype)
    if args.output_dir:
        folder = save_drafter(drafter, args.output_dir, repo_id=args.repo_id, **options)
        print(f"Wrote {folder} (not uploaded). Upload it with: hf upload {args.repo_id} {folder} .")
        return 0
    commit = push_drafter(drafter, args.repo_id, private=args.private, token=args.token, **options)
    print(f"Pushed {args.drafter} to https://huggingface.co/{args.repo_id} ({getattr(commit, 'commit_url', commit)})")
    return 0


def _load_drafter_to_push(drafter: str, target_name: str | None) -> PreTrainedModel:
    """The drafter named by ``--drafter``, a compact one bound to ``--target``; bad input exits with one line."""
    from .models import load_target

    target = None
    if target_name:
        try:
            target, _ = load_target(target_name, packed_linear="off")  # only its vocabulary tensors are read
        except (OSError, ValueError) as error:
            reason = (str(error).splitlines() or [type(error).__name__])[0]
            raise SystemExit(
                f"dspark-hf push: cannot load --target {target_name!r} ({reason}); pass the target's folder, Hub id "
                "or embedded name."
            ) from None
    try:
        return load_drafter(drafter, target=target)
    except ValueError as error:
        if target is None and "compact drafter" in str(error):
            raise SystemExit(
                f"dspark-hf push: {drafter} is a compact drafter (saved without embed_tokens / lm_head); pass "
                "--target <the target's folder, Hub id or embedded name> to bind the target's."
            ) from None
        raise SystemExit(f"dspark-hf push: cannot load --drafter {drafter!r}: {error}") from None


__all__ = [
    "render_model_card",
    "build_card_data",
    "format_benchmark",
    "format_training",
    "write_custom_generate",
    "custom_generate_source",
    "save_drafter",
    "push_drafter",
    "load_drafter",
    "PushArguments",
    "main",
]
