"""Do plain steps get slower after verification rounds run under native GQA (`generation/gqa.py`) in the engine?

Two drafter engines hold the same 32 prompts and run 10 full-block rounds each, one with native grouped-query
attention for its multi-token forwards and one without; then both, and a target-only engine over the same prompts,
run plain one-token steps interleaved in alternating order (medians of 12). The slot-axis width is printed too: rows
that accepted drafts hold longer contexts than target-only's.

    python scripts/gqa_plain_steps.py
"""

import statistics, time, torch
from dspark_hf.benchmarks.prompts import load_prompts, render_conversation
from dspark_hf.generation.batched import DSparkBatchEngine
from dspark_hf.generation import gqa
from dspark_hf.modeling_dspark import DSparkDrafter
from dspark_hf.models import DEFAULT_TARGET, EMBEDDED_DRAFTERS, drafter_dtype, load_target, target_dtype
torch.set_num_threads(2)
target, tok = load_target(DEFAULT_TARGET, dtype=target_dtype("auto"))
drafter = DSparkDrafter.from_pretrained(next(iter(EMBEDDED_DRAFTERS.values())), target=target, dtype=drafter_dtype("auto")).eval()
P = "../shared/data/eval/"
prompts = [render_conversation(tok, p.turns[:1], []) for p in load_prompts([P + "gsm8k.jsonl", P + "humaneval.jsonl"])]
prompts = [tok(t, add_special_tokens=False)["input_ids"] for t in prompts][:32]
ALWAYS = gqa.wanted
def switch(on): gqa.wanted = ALWAYS if on else (lambda d, n: False)
engines = {}
for on in (True, False):
    switch(on)
    e = DSparkBatchEngine(target, drafter, policy="full", pad_token_id=0)
    for p in prompts: e.add_request(p, 1 << 20)
    e.step()
    engines[on] = e
t_only = DSparkBatchEngine(target, None, pad_token_id=0)
for p in prompts: t_only.add_request(p, 1 << 20)
t_only.step()
# 10 drafted full-block rounds each
for _ in range(10):
    for on, e in engines.items():
        switch(on); e.step()
# now plain steps: disable drafting
for e in engines.values():
    e.policy.begin_round = lambda *a, **k: False
    e.policy.end_round = lambda *a, **k: None
times = {True: [], False: [], "target": []}
order = [True, False, "target"]
for it in range(15):
    for key in (order if it % 2 else order[::-1]):
        e = t_only if key == "target" else engines[key]
        if key != "target": switch(key)
        t = time.perf_counter(); e.step(); times[key].append(time.perf_counter() - t)
switch(True)
for k, v in times.items():
    e = t_only if k == "target" else engines[k]
    print(k, "plain step median ms", round(statistics.median(v[3:]) * 1e3, 1), "slot width", e.slot_mask.shape[1])
