"""`openforge sft`: supervised fine-tuning on recorded trajectories, loss on the assistant's tokens only.

Data: JSONL rows that are either samples (`openforge rollout`'s samples.jsonl: `input_ids` and
`loss_mask`, and `image_digests` for a vision-language model's samples) or chat conversations
(`messages`, optional `tools`: `openforge export-sft`'s rows) or ATIF trajectories (Harbor's
trajectory.json, from any agent, read as chat rows by openforgerl.atif), which are tokenised with the
student's own chat template, as the gateway would for that student; or trajectories made on the spot
by a teacher (`oracle_samples`: the tools-tiny oracle played through the ReAct harness and recorded
by the gateway).

Chat rows may show images (OpenAI image_url parts with data URLs, as export-sft writes them): they
need a vision-language student, and the decoded images travel with the loaded samples
(`SFTData.image_source`) to give the trainer their pixels. Sample rows with `image_digests` need
another image source (the gateway store's `images_sync`)."""

from __future__ import annotations

import json
import random
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from openforgerl.atif import atif_rows, is_atif
from openforgerl.images import Image, ImageError, image_from_data_url
from openforgerl.rendering import ChatRenderer, VisionRenderer
from openforgerl.rl.config import SFTConfig as SFTConfig
from openforgerl.rl.policy import ImageSource, Policy
from openforgerl.rl.trainer import MetricsLog, passed
from openforgerl.rollouts.trajectory import NO_VERSION, Sample
from openforgerl.sandbox.choice import BackendChoice
from openforgerl.vision import VisionProcessor, is_vision_model, load_processor


def _sample(
    input_ids: list[int], loss_mask: list[int], source: str = "", image_digests: list[str] | None = None
) -> Sample:
    return Sample(
        rollout_id=source,
        reward=0.0,
        branch_id=0,
        branch_reason="",
        input_ids=input_ids,
        loss_mask=loss_mask,
        logprobs=[0.0] * len(input_ids),
        policy_versions=[NO_VERSION] * len(input_ids),
        image_digests=list(image_digests or []),
    )


StudentTokenizer = Any  # a Hugging Face tokenizer, or a VisionProcessor for a vision-language student


def student_tokenizer(model_dir: str | Path) -> StudentTokenizer:
    """What tokenises chat rows for the student in `model_dir`: its VisionProcessor when it is a
    vision-language model, else its tokenizer."""
    from transformers import AutoTokenizer

    if is_vision_model(model_dir):
        return load_processor(model_dir)
    return AutoTokenizer.from_pretrained(model_dir)


def _renderer(tokenizer: StudentTokenizer) -> ChatRenderer:
    """The gateway's renderer for the student: a VisionRenderer for a processor (each image's
    placeholder expanded to its token count), a ChatRenderer for a tokenizer."""
    if isinstance(tokenizer, VisionProcessor):
        return VisionRenderer(tokenizer)
    return ChatRenderer(tokenizer)


IMAGE_PARTS = ("image_url", "input_image")  # OpenAI Chat Completions and Responses image parts
TEXT_PARTS = ("text", "input_text", "output_text")


def _part_image(part: dict[str, Any]) -> Image:
    """The image of an OpenAI image_url (or Responses input_image) part with a data URL."""
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    if not isinstance(url, str):
        raise ImageError(f"an image part without its data URL: {str(part)[:80]}")
    return image_from_data_url(url)


def _template_message(m: dict[str, Any]) -> tuple[dict[str, Any], list[Image]]:
    """A row's message in the shape the gateway gives the chat template (`Message.template_dict`:
    one {"type": "image"} per image, then the text parts joined), and its images in order."""
    if m.get("images"):
        raise ValueError(
            "a message names its images by digest only; export rows with `openforge export-sft`, "
            "which writes the images into the row"
        )
    content = m.get("content")
    if not isinstance(content, list):
        return m, []
    images: list[Image] = []
    texts: list[str] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else "text"
        if kind in IMAGE_PARTS:
            images.append(_part_image(part))
        elif kind in TEXT_PARTS:
            texts.append(part if isinstance(part, str) else str(part.get("text", "")))
        else:
            raise ValueError(f"content part type {kind!r}: a chat row's parts are text and image_url")
    text = "".join(texts)
    if not images:
        return {**m, "content": text}, []
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in images]
    if text:
        parts.append({"type": "text", "text": text})
    return {**m, "content": parts}, images


def _chat(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, renderer: ChatRenderer
) -> tuple[Sample, list[Image]]:
    converted = [_template_message(m) for m in messages]
    shaped = [m for m, _ in converted]
    images = [im for _, ims in converted for im in ims]
    if images and not renderer.takes_images:
        name = getattr(renderer.tokenizer, "name_or_path", "") or "the student"
        raise ValueError(
            f"the conversation shows {len(images)} images, but the student {name} takes no images: "
            "train a vision-language student (e.g. one made by `openforge model init --vision DIR`; "
            "from Python, pass its model dir or its openforgerl.vision.load_processor)"
        )

    def ids(n: int, prompt: bool) -> list[int]:
        text = renderer.tokenizer.apply_chat_template(
            shaped[:n], tools=tools, add_generation_prompt=prompt, tokenize=False
        )
        return renderer.encode(text, [im for _, ims in converted[:n] for im in ims])

    full = ids(len(shaped), False)
    mask = [0] * len(full)
    end_id = renderer.turn_end_id
    for i, m in enumerate(messages):
        # `weight: 0` (OpenAI's fine-tuning convention): a turn kept as context, not trained on.
        if m.get("role") != "assistant" or m.get("weight", 1) == 0:
            continue
        prompt, upto = ids(i, True), ids(i + 1, False)
        if upto[: len(prompt)] != prompt or full[: len(upto)] != upto:
            raise ValueError(
                f"the chat template does not render turn {i} as an extension of the turns before it"
            )
        end = len(upto)
        if end_id in upto[len(prompt) :]:
            end = upto.index(end_id, len(prompt)) + 1  # what follows the end-of-turn token is not sampled
        mask[len(prompt) : end] = [1] * (end - len(prompt))
    return _sample(full, mask, image_digests=[im.digest for im in images]), images


def chat_sample(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, tokenizer: StudentTokenizer
) -> Sample:
    """A conversation as one sequence in the student's chat template; mask 1 on assistant turns.

    Rendered and tokenised as the gateway does the same conversation (its renderer): a message's
    images (OpenAI image_url parts with data URLs) come before its text, each as the template's
    placeholder expanded to the image's token count, so a vision-language student's `tokenizer` (its
    VisionProcessor) gives the ids the engine would take with those pixels; the sample's
    `image_digests` name the images in order.

    Each assistant turn's tokens are what the template adds between the prompt that asks for it
    (add_generation_prompt) and the conversation that includes it, up to and including the end-of-
    turn token: what the model would sample. The template must render a conversation as a prefix of
    its continuation, as ChatML templates do.
    """
    return _chat(messages, tools, _renderer(tokenizer))[0]


class SFTData(list[Sample]):
    """Samples loaded for SFT, and the images their chat rows carried, by digest: `image_source`
    gives them to the trainer (`SFTTrainer(..., image_source=data.image_source)`)."""

    def __init__(self, samples: Iterable[Sample] = (), images: dict[str, Image] | None = None) -> None:
        super().__init__(samples)
        self.images: dict[str, Image] = dict(images or {})

    def image_source(self, digests: Sequence[str]) -> dict[str, Image]:
        return {d: self.images[d] for d in digests if d in self.images}


def _data_rows(path: Path) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, row) for each row of SFT data: JSONL lines, or ATIF trajectories as chat rows."""
    if is_atif(path):
        yield from atif_rows(path)
        return
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            yield f"{path}:{n}", json.loads(line)


def load_sft_data(path: str | Path, tokenizer: StudentTokenizer | str | Path) -> SFTData:
    """Samples from a JSONL file of sample rows or chat rows (the two may be mixed), or from ATIF
    trajectories (a trajectory.json, or a folder of them: openforgerl.atif), tokenised for the
    student: its tokenizer, its VisionProcessor (needed for rows with images), or its model dir.
    Chat rows' images are decoded once and kept in the result (`SFTData.image_source`)."""
    if isinstance(tokenizer, str | Path):
        tokenizer = student_tokenizer(tokenizer)
    renderer = _renderer(tokenizer)
    out = SFTData()
    for where, row in _data_rows(Path(path)):
        if "input_ids" in row:
            if len(row["loss_mask"]) != len(row["input_ids"]):
                raise ValueError(f"{where}: loss_mask and input_ids differ in length")
            out.append(
                _sample(
                    list(row["input_ids"]),
                    list(row["loss_mask"]),
                    row.get("rollout_id", ""),
                    row.get("image_digests"),
                )
            )
        elif "messages" in row:
            try:  # ImageError is a ValueError
                sample, images = _chat(row["messages"], row.get("tools"), renderer)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from exc
            sample.rollout_id = str(row.get("rollout_id", ""))
            out.images.update((im.digest, im) for im in images)
            out.append(sample)
        else:
            raise ValueError(f"{where}: a row needs input_ids + loss_mask, or messages")
    out[:] = [s for s in out if s.num_loss_tokens]
    return out


def oracle_samples(
    model_dir: str | Path,
    out: Path,
    *,
    tasks: str = "tools-tiny",
    split: str = "train",
    limit: int | None = None,
    max_turns: int = 8,
    concurrency: int = 8,
    progress: bool = True,
    show_work: bool = True,
    harness: str = "react",
    faulted: int | None = None,
    backend: BackendChoice | None = None,
) -> list[Sample]:
    """Teacher trajectories from the ORACLE teacher (tools-tiny, claw-basic): each task run once
    through `harness` (the built-in ReAct loop or an agent CLI) with the oracle engine behind the
    gateway, acting through that harness's own tools; the rollouts it solved, as merged samples in
    the student's chat template (the gateway renders with `model_dir`'s tokenizer). `show_work`:
    the teacher notes each value it read and writes out the computation before its calls.
    `faulted`: of the chosen tasks that carry transient faults (tools-tiny-faults), only the first
    `faulted` keep them, the others run clean (None: all keep them); the teacher reads a failed file
    again. `backend`: where the sandboxes run (default local)."""
    from openforgerl.harnesses.launch import HarnessChoice, LaunchOptions
    from openforgerl.rl.oracle_teacher import ORACLE_SUITES, OracleTeacherEngine, reference_solutions
    from openforgerl.rollouts.results import Status
    from openforgerl.rollouts.service import RolloutJob
    from openforgerl.run.folder import RunFolder
    from openforgerl.run.stack import serving
    from openforgerl.tasks import load_tasks
    from openforgerl.tasks.suites.tools_tiny import keep_faults

    if tasks not in ORACLE_SUITES:
        raise ValueError(f"the oracle teacher knows {' and '.join(ORACLE_SUITES)}, not {tasks!r}")
    chosen = load_tasks(tasks, split=split)[:limit]  # type: ignore[arg-type]
    if faulted is not None:
        chosen = keep_faults(chosen, faulted)
    max_tokens = 1024 if tasks == "claw-basic" else 256  # a reference solution is one call: room for it
    run = RunFolder(out)
    job = RolloutJob(
        HarnessChoice(harness, LaunchOptions(max_turns=max_turns, max_tokens=max_tokens)),
        run_id=run.name,
        state_path=run.runner_state,
        concurrency=concurrency,
    )
    backend = backend or BackendChoice()
    job.check(chosen, backend.name)
    out.mkdir(parents=True, exist_ok=True)
    solutions = reference_solutions() if tasks == "claw-basic" else {}
    teacher = OracleTeacherEngine(model_dir, chosen, show_work=show_work, solutions=solutions)
    with serving(
        model_dir, run.gateway_store, engine=teacher, backend=backend, run_id=run.name, max_tokens=max_tokens
    ) as stack:
        results = stack.service.run(chosen, 1, job, progress=progress)
    return [s for r in results if r.status == Status.DONE and passed(r.reward or 0.0) for s in r.samples]


def write_samples(samples: Sequence[Sample], path: Path) -> None:
    with path.open("w") as f:
        for s in samples:
            row: dict[str, Any] = {
                "input_ids": s.input_ids,
                "loss_mask": s.loss_mask,
                "rollout_id": s.rollout_id,
            }
            if s.image_digests:
                row["image_digests"] = s.image_digests
            f.write(json.dumps(row))
            f.write("\n")


class SFTTrainer:
    def __init__(
        self, model_dir: str | Path, cfg: SFTConfig, image_source: ImageSource | None = None
    ) -> None:
        self.cfg = cfg
        self.policy = Policy(
            model_dir,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            device=cfg.device,
            seed=cfg.seed,
            image_source=image_source,
            tuning=cfg.tuning,
        )
        self.step = 0
        self.scheduler: Any = None  # set by `schedule` (fit calls it); None: the constant `lr`

    def schedule(self, total_steps: int) -> None:
        """Set the learning-rate schedule for a run of `total_steps` optimizer steps."""
        from transformers import get_scheduler

        kind = {"constant": "constant_with_warmup", "cosine": "cosine"}.get(self.cfg.schedule)
        if kind is None:
            raise ValueError(f"unknown schedule {self.cfg.schedule!r}: constant or cosine")
        self.scheduler = get_scheduler(
            kind,
            self.policy.optimizer,
            num_warmup_steps=self.cfg.warmup_steps,
            num_training_steps=total_steps,
        )

    @torch.no_grad()
    def loss(self, samples: Sequence[Sample]) -> float:
        """Mean negative log-likelihood per loss token (no update)."""
        return self.policy.sft_loss(samples, self.cfg.micro_batch_tokens)[0]

    def train_step(self, samples: Sequence[Sample]) -> dict[str, float]:
        """One optimizer step on `samples` (accumulated over micro-batches)."""
        t0 = time.monotonic()
        total = sum(s.num_loss_tokens for s in samples)
        loss_sum, tokens = self.policy.sft_loss(samples, self.cfg.micro_batch_tokens, backward_scale=1.0)
        lr = self.policy.optimizer.param_groups[0]["lr"]
        grad_norm = self.policy.clip_and_step(self.cfg.max_grad_norm)
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        seconds = time.monotonic() - t0
        return {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "lr": lr,
            "sequences": len(samples),
            "tokens": tokens,
            "loss_tokens": total,
            "tokens_per_s": tokens / seconds if seconds else 0.0,
            "time/train": seconds,
        }

    def fit(
        self,
        samples: Sequence[Sample],
        out: Path,
        *,
        val: Sequence[Sample] = (),
        progress: bool = True,
    ) -> dict[str, Any]:
        """`epochs` passes over `samples` in shuffled batches; logs to out/metrics.jsonl, saves the
        model and tokenizer (HF format) to `out`. `val`: samples never trained on, whose loss is
        logged as `val_loss` every `eval_every` steps and in the summary (measured, never selected on)."""
        if not samples:
            raise ValueError("no SFT samples with a loss token")
        out.mkdir(parents=True, exist_ok=True)
        log = MetricsLog(out)
        rng = random.Random(self.cfg.seed)
        size = max(1, self.cfg.batch_size)
        first = self.loss(samples)
        val_first = val_last = self.loss(val) if val else None
        t0 = time.monotonic()
        try:
            steps = self.cfg.epochs * -(-len(samples) // size)
            self.schedule(steps)
            bar = tqdm(total=steps, desc="sft", unit="step", disable=not progress)
            for epoch in range(self.cfg.epochs):
                order = list(samples)
                rng.shuffle(order)
                for i in range(0, len(order), size):
                    metrics: dict[str, Any] = {"epoch": epoch, **self.train_step(order[i : i + size])}
                    if val and self.cfg.eval_every and self.step % self.cfg.eval_every == 0:
                        metrics["val_loss"] = val_last = self.loss(val)
                    log.write(self.step, metrics)
                    bar.update(1)
                    bar.set_postfix_str(f"loss {metrics['loss']:.3f}")
            bar.close()
        finally:
            log.close()
        last = self.loss(samples)
        logged_last = self.cfg.eval_every > 0 and self.step % self.cfg.eval_every == 0
        self.policy.save_model(out)
        return {
            "samples": len(samples),
            "steps": self.step,
            "loss_before": first,
            "loss_after": last,
            "val_samples": len(val),
            "val_loss_before": val_first,
            # Measured once: the last step's logged value when it logged one.
            "val_loss_after": val_last if logged_last else (self.loss(val) if val else None),
            "seconds": round(time.monotonic() - t0, 1),
            "model": str(out),
        }
