"""transformers continuous batching with async batching on a shared GPU: wrong greedy tokens, then SIGABRT.
Needs torch and transformers only. Usage: python transformers_cb_async_race.py [--async on|off] [--graphs on|off]
[--stress 3] [--cpu 6] [--repeat 5]. Exit 0: every batch matched plain greedy decoding; 1: a mismatch."""
import argparse, ctypes, inspect, os, time
import torch, torch.multiprocessing as mp
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM
from transformers.generation.configuration_utils import ContinuousBatchingConfig

def tenant(seed, gpu):  # another process on the machine: bf16 matmul bursts on the GPU at random gaps, or a busy core
    ctypes.CDLL(None).prctl(1, 9)  # die with the parent, even when it aborts
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16) if gpu else None
    while True:
        if not gpu:
            continue
        for _ in range(int(torch.randint(1, 40, (1,), generator=g))):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize(); time.sleep(float(torch.rand(1, generator=g)) * 0.02)

def main():
    p = argparse.ArgumentParser()
    for k in ("--async", "--graphs"): p.add_argument(k, dest=k[2:] + "_on", default="on", choices=("on", "off"))
    for k, d in (("--stress", 3), ("--cpu", 6), ("--repeat", 5)): p.add_argument(k, type=int, default=d)
    a = p.parse_args()
    ctx = mp.get_context("spawn")
    for i in range(a.stress + a.cpu): ctx.Process(target=tenant, args=(i, i < a.stress), daemon=True).start()
    torch.manual_seed(0)  # a tiny Llama; large init so greedy tokens are not near-ties
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, head_dim=64, max_position_embeddings=128, initializer_range=0.2)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    prompts = [[0], [(3 * i * i + i) % 3 for i in range(62)] + [0], [5, 9, 4], [7] * 20]
    new = [1, 4, 6, 3]
    with torch.no_grad():  # plain greedy decoding: the whole sequence through the model, no cache
        def plain(ids, n):
            for _ in range(n): ids = ids + [int(model(torch.tensor([ids], device="cuda")).logits[0, -1].argmax())]
            return ids[-n:]
        want = [plain(q, n) for q, n in zip(prompts, new)]
    kw = dict(page_size=8, num_blocks=17, max_batch_tokens=32, max_requests_per_batch=4, scheduler_type="fifo",
              use_async_batching=a.async_on == "on", use_cuda_graph=a.graphs_on == "on", seed=0)
    if "page_size" not in inspect.signature(ContinuousBatchingConfig).parameters: kw["block_size"] = kw.pop("page_size")
    bad = 0
    for rep in range(a.repeat):
        m = model.init_continuous_batching(generation_config=GenerationConfig(do_sample=False, eos_token_id=-1),
                                           continuous_batching_config=ContinuousBatchingConfig(**kw))
        m.warmup(); m.start()
        for i, (q, n) in enumerate(zip(prompts, new)): m.add_request(q, request_id=f"r{i}", max_new_tokens=n, eos_token_id=-1)
        got, end = {}, time.monotonic() + 60
        while len(got) < len(prompts) and time.monotonic() < end:
            out = m.get_result(timeout=0.5)
            if out is not None and out.is_finished(): got[out.request_id] = [int(t) for t in out.generated_tokens]
        m.stop(block=True); m.destroy()
        for i, w in enumerate(want):
            ok = got.get(f"r{i}") == w; bad += not ok
            print(f"batch {rep} r{i}: {'ok ' if ok else 'BAD'} got {got.get(f'r{i}')} plain {w}", flush=True)
    print(f"transformers {__import__('transformers').__version__} torch {torch.__version__} async={a.async_on} "
          f"graphs={a.graphs_on} stress={a.stress} cpu={a.cpu}: {bad} wrong of {a.repeat * len(prompts)}", flush=True)
    os._exit(1 if bad else 0)

if __name__ == "__main__":
    main()
