"""Options several commands share: the upstream models, harnesses and tasks (eval, rollout, train,
sft), the sandbox backend rollouts run in (eval, rollout, train, sft, tasks check), the trainers'
tuning (train, sft), and where a container backend is (doctor, gc).

Defaults are read from the config dataclasses (light modules); what the options become is built
lazily inside the helpers, so importing this module pulls in nothing heavy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import click

from openforgerl.eval_options import NOT_OPTIONS, EvalOptions
from openforgerl.gateway.config import UpstreamSpec
from openforgerl.harnesses.adapters import HARNESSES
from openforgerl.sandbox.choice import BACKENDS, DEFAULT_IMAGE, BackendChoice

CLI_HARNESSES = list(HARNESSES)  # the agent CLI adapters, for the help texts


def field_default(cls: type, name: str) -> Any:
    """The default of dataclass `cls`'s field `name` (also for slotted dataclasses, whose class
    attributes are not their defaults)."""
    for f in dataclasses.fields(cls):
        if f.name == name:
            if f.default is dataclasses.MISSING:
                raise TypeError(f"{cls.__name__}.{name} has no plain default")
            return f.default
    raise AttributeError(f"{cls.__name__} has no field {name}")


def apply(options: Sequence[Callable[[Any], Any]], fn: Any) -> Any:
    """Decorate `fn` with `options`, the first on top (as if written above it in that order)."""
    for option in reversed(options):
        fn = option(fn)
    return fn


def upstream_options(fn: Any) -> Any:
    """--upstream, --upstream-key-env and --upstream-timeout (the gateway, and eval's embedded one)."""
    return apply(
        [
            click.option(
                "--upstream",
                "upstreams",
                multiple=True,
                metavar="NAME=KIND:MODEL[@BASE_URL]",
                help='An external model rollouts created with "upstream": NAME are answered by (recorded '
                "as text), KIND openai or anthropic, e.g. teacher=openai:gpt-4.1, judge=openai:gpt-4.1 "
                "(the web tasks' LLM judge) or claude=anthropic:claude-sonnet-4-5@https://api.anthropic.com. "
                "Repeatable.",
            ),
            click.option(
                "--upstream-key-env",
                "upstream_key_envs",
                multiple=True,
                metavar="NAME=ENVVAR",
                help="The variable holding upstream NAME's key (default OPENAI_API_KEY / ANTHROPIC_API_KEY).",
            ),
            click.option(
                "--upstream-timeout",
                type=float,
                default=field_default(UpstreamSpec, "timeout"),
                show_default=True,
                help="Seconds per upstream call.",
            ),
        ],
        fn,
    )


def upstream_specs(upstreams: Sequence[str], key_envs: Sequence[str], timeout: float) -> list[Any]:
    """The UpstreamSpecs of the --upstream / --upstream-key-env options; a bad one is a usage error."""
    from openforgerl.gateway.upstream import parse_key_env, parse_upstream, with_key_envs

    try:
        return with_key_envs(
            [parse_upstream(u, timeout=timeout) for u in upstreams],
            dict(parse_key_env(k) for k in key_envs),
        )
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--upstream / --upstream-key-env") from exc


def harness_list(ctx: click.Context, param: click.Parameter, value: str) -> list[str]:
    """--harness: one name, or (for eval) several comma-separated, each a known harness."""
    from openforgerl.harnesses.launch import check_name

    names = [n.strip() for n in value.split(",") if n.strip()]
    if not names:
        raise click.BadParameter("name a harness", ctx, param)
    for name in names:
        try:
            check_name(name)
        except ValueError as exc:
            raise click.BadParameter(str(exc), ctx, param) from exc
    return names


def one_harness(ctx: click.Context, param: click.Parameter, value: str) -> str:
    names = harness_list(ctx, param, value)
    if len(names) > 1:
        raise click.BadParameter("one harness here (eval compares several)", ctx, param)
    return names[0]


def _harness_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[str] | None:
    return None if value is None else harness_list(ctx, param, value)


def rollout_options(skip: Sequence[str] = ()) -> Callable[[Any], Any]:
    """The options of `eval` and `rollout`: EvalOptions' settings (less `skip`), then the upstream
    models' and the sandbox backend's."""
    from openforgerl.config_options import config_options

    more: dict[str, dict[str, Any]] = {
        "tasks": {"required": True},
        "harness": {"callback": _harness_list, "help_more": f" Agent CLIs: {', '.join(CLI_HARNESSES)}."},
        "admin_token": {"envvar": "OPENFORGE_ADMIN_TOKEN"},
    }

    def decorate(fn: Any) -> Any:
        fn = config_options(EvalOptions, skip=(*NOT_OPTIONS, *skip), more=more)(fn)
        return sandbox_options()(upstream_options(fn))

    return decorate


def eval_options(kw: dict[str, Any], default_out: str, skip: Sequence[str] = ()) -> EvalOptions:
    """The EvalOptions of `eval`'s and `rollout`'s options: the settings given over the defaults."""
    from openforgerl.config_options import given_settings
    from openforgerl.modelkit import cached_model

    given = given_settings(EvalOptions, kw, skip=(*NOT_OPTIONS, *skip))
    upstreams = upstream_specs(kw["upstreams"], kw["upstream_key_envs"], kw["upstream_timeout"])
    if upstreams and given.get("gateway") is not None:
        raise click.UsageError(
            "--upstream configures the embedded gateway; a running gateway (--gateway) serves its own "
            "(openforge gateway --upstream ...)"
        )
    if given.get("model") is None and given.get("gateway") is None:
        given["model"] = str(cached_model("tiny", 0))
        click.echo(f"no --model or --gateway: serving the tiny local model {given['model']}", err=True)
    given["out"] = Path(given.get("out") or default_out)
    names = given.pop("harness", None) or [EvalOptions.harness]  # the first; eval's study takes them all
    return EvalOptions(**given, harness=names[0], upstreams=upstreams, backend=backend_choice(kw))


def refusing_bad_network(run: Any, opts: Any) -> Any:
    """Live-site tasks without --network host: a usage error that names the option. A task set that
    cannot be loaded: its problems (one line per bad task or folder), no traceback."""
    from openforgerl.harnesses.launch import HarnessNotInstalled
    from openforgerl.rollouts.runner import NetworkNotAllowed, TaskNeedsImage
    from openforgerl.tasks.files import TaskError

    try:
        return run(opts)
    except TaskError as exc:
        raise click.ClickException(str(exc)) from exc
    except NetworkNotAllowed as exc:
        raise click.UsageError(str(exc)) from exc
    except TaskNeedsImage as exc:
        raise click.ClickException(str(exc)) from exc
    except HarnessNotInstalled as exc:
        raise click.ClickException(str(exc)) from exc


def sandbox_options(*more: str, help_more: str = "") -> Callable[[Any], Any]:
    """--backend (local, docker, kubernetes, and `more`: train's verl) with the backend's settings:
    --image, --docker-host, --backend-config; `backend_choice` turns them into a BackendChoice."""

    def decorate(fn: Any) -> Any:
        return apply(
            [
                click.option(
                    "--backend",
                    type=click.Choice([*BACKENDS, *more]),
                    default="local",
                    show_default=True,
                    help="Where rollouts run. local: bubblewrap sandboxes with the host's tools (tasks "
                    "bound to an image are refused); docker: a container per rollout, each task in its "
                    "own image (built once from its Dockerfile, or its docker_image), the others in "
                    "--image; kubernetes: a Pod per rollout (--backend-config)." + help_more,
                ),
                click.option(
                    "--image",
                    default=DEFAULT_IMAGE,
                    show_default=True,
                    help="docker, kubernetes: the image of tasks that name none (`make docker-base` "
                    "builds the default offline).",
                ),
                click.option(
                    "--docker-host",
                    default=None,
                    metavar="URL",
                    help="docker: the engine, e.g. unix:///run/docker.sock (default: $DOCKER_HOST, "
                    "else the local socket).",
                ),
                click.option(
                    "--backend-config",
                    type=click.Path(dir_okay=False, exists=True),
                    default=None,
                    help="The backend's settings (YAML): DockerConfig's (runtime, tmpfs_size, ...) or "
                    "the Kubernetes backend's (as deploy/kubernetes/backend.yaml).",
                ),
            ],
            fn,
        )

    return decorate


def backend_choice(kw: dict[str, Any], backend: str | None = None) -> BackendChoice:
    """The BackendChoice of the sandbox options (popped from `kw`; `backend` when the caller popped
    --backend already); a setting the backend does not know is a usage error."""
    import yaml

    name: Any = kw.pop("backend") if backend is None else backend  # one of BACKENDS: click checked it
    settings: dict[str, Any] = {}
    config = kw.pop("backend_config")
    if config:
        settings = yaml.safe_load(Path(config).read_text()) or {}
        if not isinstance(settings, dict):
            raise click.BadParameter("a YAML mapping of settings", param_hint="--backend-config")
    host = kw.pop("docker_host")
    if host:
        settings["base_url"] = host
    choice = BackendChoice(name, kw.pop("image"), settings)
    if name != "local":
        try:
            choice.make("check")  # only builds the config: nothing is reached yet
        except (ValueError, TypeError) as exc:
            raise click.BadParameter(str(exc), param_hint="--backend-config / --docker-host") from exc
    return choice


def backend_options(fn: Any) -> Any:
    """Where a container backend is: options shared by `doctor --backend` and `gc`."""
    return apply(
        [
            click.option(
                "--config",
                "backend_config",
                type=click.Path(dir_okay=False, exists=True),
                default=None,
                help="The Kubernetes backend's settings (YAML, as deploy/kubernetes/backend.yaml).",
            ),
            click.option("--namespace", default=None, help="Kubernetes namespace (default: the config's)."),
            click.option(
                "--kubeconfig", default=None, help="Kubeconfig file (default $KUBECONFIG, ~/.kube/config)."
            ),
            click.option("--context", default=None, help="Kubeconfig context."),
        ],
        fn,
    )


def kubernetes_config(
    backend_config: str | None, namespace: str | None, kubeconfig: str | None, context: str | None
) -> Any:
    import yaml

    from openforgerl.sandbox.kubernetes import KubernetesConfig

    settings: dict[str, Any] = {"run_id": "doctor", "image": "none"}
    if backend_config:
        settings |= yaml.safe_load(Path(backend_config).read_text()) or {}
    overrides = {"namespace": namespace, "kubeconfig": kubeconfig, "context": context}
    return KubernetesConfig.model_validate(settings | {k: v for k, v in overrides.items() if v is not None})
