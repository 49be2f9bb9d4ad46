"""Shape accuracy on held-out v2 training pictures (recipes/tiny/vision/data.py variety=True, seeds 777000+i that no
training batch draws), thinking mode, greedy, through the engine as independent_eval does:
    python recipes/tiny/logs/trials-2026-12-03/v2_shape_check.py CHECKPOINT [N]
Run for the checkpoints after stages 29 and 30 (v2_shape_check_s29_s30.txt)."""
import random, sys, torch
from types import SimpleNamespace
from dsv41.model.checkpoint import load_model
from dsv41.model.engine import Generator
from dsv41.model.completion import parse_completion
from dsv41.recipes.tiny.vision import data as D
from dsv41.recipes.tiny.vision.independent_eval import build_requests
from dsv41.recipes.tiny.vision.accuracy import score, answered
model_dir = sys.argv[1]; n=int(sys.argv[2]) if len(sys.argv)>2 else 120
model, args, tok = load_model(model_dir)
torch.set_num_threads(1)
pics=[]
for i in range(n):
    rng=random.Random(777_000+i)
    ex=D.make_example(rng, kind="shape", question_type="shape", variety=True)
    pics.append(SimpleNamespace(image=ex.image, questions={"shape": ex.question, "colour": ex.question}, facts=ex.facts, colour=ex.facts["colour"], shape=ex.facts["shape"]))
with torch.inference_mode():
    eng=Generator(model, tok)
    for mode in ("thinking",):
        res=eng.generate_many(build_requests(pics, mode, "shape", tok, args, 24), max_batch_size=32)
        ok=0; conf={}
        for p,r in zip(pics,res):
            c=parse_completion(tok.decode(r.output_ids), mode, finished=r.finish_reason=="stop").content
            s=score("shape", p, c); ok+=s
            conf.setdefault(p.shape,{}).setdefault(answered("shape",c),0); conf[p.shape][answered("shape",c)]+=1
        print(mode, ok, n, ok/n); print(conf)
