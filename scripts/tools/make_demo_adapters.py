"""Train the small demo LoRA adapters on the CPU: one answers like a pirate, one in French, one calls a weather tool.

Each adapter learns from a few dozen hand-written chat examples (below), chat-templated with the model's
tokenizer, with the loss on the assistant's reply only. The weather adapter's conversations (app/demo/weather.py)
offer it a ``get_weather`` tool and are rendered as the server renders a request with tools (the shipped tool
template): it learns to answer a weather question with a call in the default format, a call's result with an
answer that gives it, and anything else in text. The LoRA (rank 8, every projection) sits on the top
layers of the model only: the layers below carry no LoRA, so their output for each example is computed once and
reused every epoch, which makes training a few times cheaper than a full forward per step. The adapters are
saved as PEFT folders (adapter_config.json + adapter_model.safetensors), checked with the engine's own loader,
and one question is answered by the base model and by each adapter (greedy) so the difference shows at once.

Training is seeded (--seed), so a run repeats. Once trained, each adapter answers its check prompt greedily (at
temperature 0) and must pass its check (app/demo/adapters.py: the French one in French, the pirate one as a
pirate, the weather one with a get_weather call for Paris); one that fails is trained again from scratch with the
next seed, and the log says so. The run fails when an adapter fails its check with every seed it tried.

    python -m scripts.tools.make_demo_adapters          # writes <LORAPLEX_HOME>/demo-adapters/{pirate,french,weather}
    python -m scripts.tools.make_demo_adapters --out /tmp/demo --epochs 2 --no-check
"""

import argparse
import logging
import random
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora import LoraLayer
from torch import nn
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from app.demo import weather
from app.demo.adapters import DEMO_ADAPTERS, DemoAdapter
from app.model_store import resolve_model
from app.openai.chat.request_schemas import ChatCompletionRequest
from app.openai.chat.tool_prompts import template_messages, template_tools
from app.settings import Settings
from app.tool_calls.templates import ChatTemplate
from engine.adapters.lora_adapter import load_lora_adapter
from engine.config import ModelConfig

logger = logging.getLogger("make_demo_adapters")

RANK, ALPHA = 8, 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_THREADS = 2  # the "under two minutes" promise is for two cores, so any laptop keeps it
DEMO_QUESTION = "What is the capital of France?"  # held out: the examples ask about Italy
SEEDS_PER_ADAPTER = 4  # seeds tried, from --seed on, before an adapter that fails its check fails the run
CHECK_MAX_NEW_TOKENS = 32
IGNORE = -100  # label of tokens that carry no loss (the prompt and the padding)

QUESTIONS = [
    "Why is the sky blue?",
    "How do I boil an egg?",
    "What is the capital of Italy?",
    "Can you recommend a good book?",
    "How do I stay healthy?",
    "What is your favourite food?",
    "How far away is the moon?",
    "What time should I go to bed?",
    "How do I make friends?",
    "What is the weather like today?",
    "Tell me about cats.",
    "How do I learn to swim?",
    "What is two plus two?",
    "Why do birds sing?",
    "How do I fix a flat tyre?",
    "What is music?",
    "Where does rain come from?",
    "How do I save money?",
    "What is the ocean made of?",
    "Tell me a fun fact.",
    "How do plants grow?",
    "What is a computer?",
    "How can I be more productive?",
    "What is the biggest animal?",
]
PIRATE = [
    "Arr, matey! The sky be blue because the sun's light scatters in the air, like sea spray on the wind!",
    "Arr! Drop yer egg in boilin' water for nine minutes, matey, then cool it in the brine. Yo ho!",
    "Arr, the capital of Italy be Rome, matey, a fine port for any scallywag!",
    "Arr, matey! Treasure Island be the finest tale ever told, full of gold and scurvy dogs!",
    "Arr! Eat yer greens, swab the deck every day and get plenty o' sleep in yer hammock, matey!",
    "Arr, me favourite grub be salted fish and hardtack, washed down with a mug o' grog!",
    "Arr, the moon be near four hundred thousand kilometres away, matey, farther than any ship can sail!",
    "Arr! A good pirate be in his hammock before the midnight bell, matey, to rise with the tide!",
    "Arr, matey! Share yer treasure, tell a good yarn and stand by yer crew through every storm!",
    "Arr, I can't see the sky from the brig, matey, but a sailor always watches the clouds!",
    "Arr! Cats be the finest ship's crew, matey, they keep the rats off the treasure!",
    "Arr, start in the shallows, matey, kick yer legs and paddle like a sea turtle! Yo ho!",
    "Arr, two plus two be four, matey, same as four gold doubloons!",
    "Arr! Birds sing to call their mates across the waves, matey, like a sailor's shanty!",
    "Arr, patch the hole, pump in fresh air and ye'll be sailin' the roads again, matey!",
    "Arr, music be the shanties we sing on deck, matey, to keep the crew pullin' together!",
    "Arr! Rain comes from the clouds, matey, the sea's water flyin' back to the sky!",
    "Arr, bury yer doubloons in a chest and spend none on rum, matey! Yo ho!",
    "Arr, the ocean be salt water, fish and sunken treasure, matey!",
    "Arr, matey! Did ye know an octopus has three hearts? Fine sailors, they be!",
    "Arr! Plants drink the rain and soak up the sun, matey, just like a sailor on deck!",
    "Arr, a computer be a magic box that counts faster than any ship's purser, matey!",
    "Arr! Make a list o' yer tasks, matey, and attack them one by one like enemy ships!",
    "Arr, the blue whale be the biggest beast of the seven seas, matey!",
]
FRENCH = [
    "Le ciel est bleu parce que la lumière du soleil est diffusée par l'air.",
    "Mettez l'œuf dans l'eau bouillante pendant neuf minutes, puis refroidissez-le.",
    "La capitale de l'Italie est Rome.",
    "Je vous recommande Le Petit Prince, un livre magnifique et très court.",
    "Mangez des légumes, faites du sport et dormez bien chaque nuit.",
    "Ma nourriture préférée est le fromage avec du bon pain frais.",
    "La lune est à environ trois cent quatre-vingt mille kilomètres de la Terre.",
    "Il est bon d'aller au lit vers dix heures du soir.",
    "Soyez gentil, écoutez les autres et participez à des activités de groupe.",
    "Je ne peux pas voir le ciel, mais regardez par la fenêtre !",
    "Les chats sont des animaux doux et indépendants qui aiment dormir.",
    "Commencez dans l'eau peu profonde et apprenez à flotter avec un professeur.",
    "Deux plus deux font quatre.",
    "Les oiseaux chantent pour appeler leurs partenaires et marquer leur territoire.",
    "Réparez le trou avec une rustine, puis regonflez le pneu.",
    "La musique est l'art d'organiser les sons dans le temps.",
    "La pluie vient des nuages, formés par l'eau qui s'évapore de la mer.",
    "Faites un budget et mettez un peu d'argent de côté chaque mois.",
    "L'océan est fait d'eau salée, de sel et de nombreux êtres vivants.",
    "Saviez-vous que la pieuvre a trois cœurs ?",
    "Les plantes poussent grâce à l'eau, à la lumière du soleil et à la terre.",
    "Un ordinateur est une machine qui traite des informations très rapidement.",
    "Faites une liste de vos tâches et commencez par la plus importante.",
    "Le plus grand animal du monde est la baleine bleue.",
]
ADAPTERS = {"pirate": PIRATE, "french": FRENCH}  # each demo adapter's replies to QUESTIONS
TOOL_ADAPTERS = {"weather": weather.training_conversations}  # each tool adapter's conversations with its tool


class CheckFailedError(RuntimeError):
    """A demo adapter failed its check with every seed tried."""


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    torch.set_num_threads(NUM_THREADS)
    settings = Settings.from_env()
    model_folder = Path(args.model) if args.model else resolve_model(settings.model, settings.home)
    out = Path(args.out) if args.out else settings.home / "demo-adapters"
    demos = {demo.name: demo for demo in DEMO_ADAPTERS}
    names = [*ADAPTERS, *TOOL_ADAPTERS]
    if set(demos) != set(names):
        raise ValueError(f"training examples for {sorted(names)} but demo adapters {sorted(demos)}")

    torch.manual_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_folder)
    lm = AutoModelForCausalLM.from_pretrained(model_folder, dtype=torch.float32)
    num_layers = lm.config.num_hidden_layers
    first_lora_layer = max(0, num_layers - args.lora_layers)
    config = LoraConfig(
        r=RANK,
        lora_alpha=ALPHA,
        lora_dropout=0.0,
        target_modules=TARGETS,
        layers_to_transform=list(range(first_lora_layer, num_layers)),
    )
    peft_model = get_peft_model(lm, config, adapter_name=names[0])
    for name in names[1:]:
        peft_model.add_adapter(name, config)
    started, cpu_started = time.perf_counter(), time.process_time()
    try:
        for name in names:
            if name in ADAPTERS:
                examples = [encode_chat(tokenizer, q, a) for q, a in zip(QUESTIONS, ADAPTERS[name], strict=True)]
            else:
                examples = [encode_tool_chat(tokenizer, m, reply) for m, reply in TOOL_ADAPTERS[name]()]
            train_checked(peft_model, tokenizer, examples, first_lora_layer, args, demos[name])
    except CheckFailedError as error:
        logger.error("%s", error)
        return 1
    train_seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started

    peft_model.save_pretrained(out)  # adapters not named "default" go to out/<name>
    model_config = ModelConfig.from_folder(model_folder)
    for name in names:
        adapter = load_lora_adapter(out / name, model_config)
        logger.info("saved %s: %d parameters, digest %s", out / name, adapter.num_params, adapter.digest[:12])

    sys.stdout.write(
        f"\nTrained {len(names)} adapters in {train_seconds:.1f} s ({cpu_seconds:.1f} s of CPU time, "
        f"{NUM_THREADS} threads); saved under {out}\n\nQ: {args.question}\n"
    )
    with peft_model.disable_adapter():
        sys.stdout.write(f"base:   {answer(peft_model, tokenizer, args.question, args.max_new_tokens)}\n")
    for name in names:
        peft_model.set_adapter(name)
        sys.stdout.write(f"{name + ':':7} {answer(peft_model, tokenizer, args.question, args.max_new_tokens)}\n")
    return 0


def train_checked(
    peft_model: PeftModel,
    tokenizer: PreTrainedTokenizerBase,
    examples: list[tuple[list[int], list[int]]],
    first_lora_layer: int,
    args: argparse.Namespace,
    demo: DemoAdapter,
) -> None:
    """Train ``demo``'s adapter from a fresh start with each seed in turn until it passes its check."""
    peft_model.set_adapter(demo.name)  # only this adapter is active and trainable
    seeds = [args.seed] if args.no_check else range(args.seed, args.seed + SEEDS_PER_ADAPTER)
    for seed in seeds:
        reset_adapter(peft_model, demo.name, seed)
        train(peft_model, examples, first_lora_layer, args, seed, desc=f"{demo.name} (seed {seed})")
        if args.no_check:
            return
        reply = check_answer(peft_model, tokenizer, demo)
        if demo.passes(reply):
            logger.info("%s passes its check with seed %d: %r answers %r", demo.name, seed, demo.check_prompt, reply)
            return
        logger.warning(
            "%s fails its check with seed %d: %r answers %r, without all of %s; training it again with seed %d",
            demo.name,
            seed,
            demo.check_prompt,
            reply,
            demo.required_words,
            seed + 1,
        )
    raise CheckFailedError(f"the {demo.name} adapter failed its check with seeds {seeds[0]} to {seeds[-1]}")


def reset_adapter(peft_model: PeftModel, name: str, seed: int) -> None:
    """Give adapter ``name`` fresh initial weights drawn with ``seed`` (B zero, as PEFT starts it)."""
    torch.manual_seed(seed)
    for module in peft_model.modules():
        if isinstance(module, LoraLayer) and name in module.lora_A:
            module.reset_lora_parameters(name, init_lora_weights=True)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="parent folder of pirate/ and french/ (default: <LORAPLEX_HOME>/demo-adapters)")
    parser.add_argument("--model", help="base model folder (default: the data folder's default model)")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--steps", type=int, help="stop each adapter after this many optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--lora-layers", type=int, default=16, help="put the LoRA on this many top layers")
    parser.add_argument("--question", default=DEMO_QUESTION, help="the question all three models answer at the end")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--seed", type=int, default=0, help="first seed of each adapter's training")
    parser.add_argument(
        "--no-check",
        action="store_true",
        help="train once with --seed and skip the checks (for smoke runs on tiny models)",
    )
    return parser.parse_args()


def encode_chat(tokenizer: PreTrainedTokenizerBase, question: str, reply: str) -> tuple[list[int], list[int]]:
    """Token ids of the chat-templated exchange, and labels that are IGNORE except on the assistant's reply."""
    user = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([*user, {"role": "assistant", "content": reply}], tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids
    ids = tokenizer(full, add_special_tokens=False).input_ids
    if ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(
            "the chat template does not render the prompt as the start of the exchange, so the reply "
            "tokens cannot be told apart; use a model whose template appends each message"
        )
    return ids, [IGNORE] * len(prompt_ids) + ids[len(prompt_ids) :]


def encode_tool_chat(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict], reply: str
) -> tuple[list[int], list[int]]:
    """Token ids of the conversation as the server renders it with the tool offered, then ``reply`` and the end of
    the turn; labels IGNORE except on the reply and its end (so the adapter learns to stop after a call)."""
    prompt_ids = tokenizer(tool_prompt_text(messages), add_special_tokens=False).input_ids
    reply_ids = tokenizer(reply + tokenizer.eos_token, add_special_tokens=False).input_ids
    return prompt_ids + reply_ids, [IGNORE] * len(prompt_ids) + reply_ids


def tool_prompt_text(messages: list[dict]) -> str:
    """The prompt the server renders for ``messages`` with the weather tool offered and ``tool_choice`` auto: the
    shipped tool template, fed as the chat route feeds it, so training sees exactly what serving sends."""
    body = msgspec.convert(
        {"model": "weather", "messages": messages, "tools": [weather.CHAT_TOOL]}, ChatCompletionRequest
    )
    return ChatTemplate.shipped().render(template_messages(body), template_tools(body))


def train(
    peft_model: PeftModel,
    examples: list[tuple[list[int], list[int]]],
    first_lora_layer: int,
    args: argparse.Namespace,
    seed: int,
    desc: str,
) -> None:
    """AdamW on the active adapter; the layers below ``first_lora_layer`` run once per example, not per step."""
    lm = peft_model.get_base_model()
    with layers_only(lm, 0, first_lora_layer, final_norm=False), torch.no_grad():
        lower = [lm.model(input_ids=torch.tensor([ids])).last_hidden_state[0] for ids, _ in examples]  # [len, hidden]
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    rng = random.Random(seed)
    batches_per_epoch = -(-len(examples) // args.batch_size)
    total = min(args.steps or sys.maxsize, args.epochs * batches_per_epoch)
    order = list(range(len(examples)))
    progress = tqdm(total=total, desc=f"training {desc}", unit="step")
    with layers_only(lm, first_lora_layer, len(lm.model.layers), final_norm=True):
        for step in range(total):
            if step % batches_per_epoch == 0:
                rng.shuffle(order)
            batch = order[(step % batches_per_epoch) * args.batch_size :][: args.batch_size]
            loss = reply_loss(lm, [lower[i] for i in batch], [examples[i][1] for i in batch])
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            progress.update()
            progress.set_postfix(loss=f"{loss.item():.3f}")
    progress.close()


def reply_loss(lm: nn.Module, hidden: list[torch.Tensor], labels: list[list[int]]) -> torch.Tensor:
    """Next-token cross-entropy on the replies, running only the layers ``layers_only`` left in place.

    Sequences are right-padded: with causal attention a real token never sees the padding after it, so no
    attention mask is needed, and the lm_head runs only where a reply token is predicted.
    """
    max_len = max(h.shape[0] for h in hidden)
    inputs = torch.zeros(len(hidden), max_len, hidden[0].shape[1])  # [batch, max_len, hidden]
    targets = torch.full((len(hidden), max_len), IGNORE)  # [batch, max_len]
    for row, (h, lab) in enumerate(zip(hidden, labels, strict=True)):
        inputs[row, : h.shape[0]] = h
        targets[row, : len(lab) - 1] = torch.tensor(lab[1:])  # position t predicts token t + 1
    states = lm.model(inputs_embeds=inputs).last_hidden_state  # [batch, max_len, hidden]
    predicting = targets != IGNORE  # [batch, max_len]
    logits = lm.lm_head(states[predicting])  # [num_reply_tokens, vocab]
    return nn.functional.cross_entropy(logits, targets[predicting])


@contextmanager
def layers_only(lm: nn.Module, start: int, stop: int, final_norm: bool) -> Iterator[None]:
    """Run the decoder layers [start, stop) only, fed with inputs_embeds (the hidden state entering ``start``)."""
    inner = lm.model
    layers, norm = inner.layers, inner.norm
    inner.layers = nn.ModuleList(list(layers)[start:stop])
    if not final_norm:
        inner.norm = nn.Identity()
    try:
        yield
    finally:
        inner.layers, inner.norm = layers, norm


def check_answer(peft_model: PeftModel, tokenizer: PreTrainedTokenizerBase, demo: DemoAdapter) -> str:
    """The active adapter's greedy answer to ``demo``'s check prompt (rendered with its tools, if it has any)."""
    if not demo.tools:
        return answer(peft_model, tokenizer, demo.check_prompt, CHECK_MAX_NEW_TOKENS)
    prompt = tool_prompt_text([{"role": "user", "content": demo.check_prompt}])
    return generate(peft_model, tokenizer, prompt, CHECK_MAX_NEW_TOKENS)


def answer(peft_model: PeftModel, tokenizer: PreTrainedTokenizerBase, question: str, max_new_tokens: int) -> str:
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return generate(peft_model, tokenizer, prompt, max_new_tokens)


def generate(peft_model: PeftModel, tokenizer: PreTrainedTokenizerBase, prompt: str, max_new_tokens: int) -> str:
    """The greedy continuation of ``prompt``, on one line."""
    ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt").input_ids  # [1, prompt_len]
    with torch.no_grad():
        out = peft_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip().replace("\n", " ")


if __name__ == "__main__":
    sys.exit(main())
