"""A GPT training script in the shape of SMP's examples (train_gpt_simple.py), with ``import jmp as smp``.

The configuration comes from SageMaker's ``SM_HP_MP_PARAMETERS``; the model is built inside
``smp.model_creation``, param groups split by ``model.named_parameters()``, a Hugging Face LR scheduler
drives the optimizer, the step function takes the ``args`` namespace, and evaluation reads
``outputs["logits"]`` under ``torch.no_grad()``. Only the import line differs from a script for SMP.
"""

import argparse

import torch
import transformers

import jmp as smp


def parse_args(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model_type", default="gpt_neox", choices=["gpt_neox", "gptj"])
    parser.add_argument("--train_batch_size", type=int, default=8)
    parser.add_argument("--seq_length", type=int, default=16)
    parser.add_argument("--max_steps", type=int, default=4)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--weight_decay", type=float, default=0.01)
    parser.add_argument("--grad_clip", type=float, default=1.0)
    parser.add_argument("--warmup_steps", type=int, default=1)
    parser.add_argument("--fp16", type=int, default=0)
    parser.add_argument("--bf16", type=int, default=0)
    parser.add_argument("--seed", type=int, default=12345)
    return parser.parse_args(argv)


def model_config(args):
    common = dict(vocab_size=128, bos_token_id=0, eos_token_id=1, use_cache=False)  # training: no KV cache
    if args.model_type == "gpt_neox":
        return transformers.GPTNeoXConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=args.seq_length, hidden_dropout=0.0, attention_dropout=0.0, **common,
        )  # fmt: skip
    return transformers.GPTJConfig(
        n_embd=64, n_layer=2, n_head=4, n_positions=args.seq_length, rotary_dim=8, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, **common,
    )  # fmt: skip


def batches(args, count):
    generator = torch.Generator().manual_seed(args.seed)
    for _ in range(count):
        ids = torch.randint(0, 128, (args.train_batch_size, args.seq_length), generator=generator)
        yield ids, torch.ones_like(ids)


@smp.step
def train_step(model, optimizer, input_ids, attention_mask, args):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


@smp.step
def eval_step(model, input_ids, attention_mask):
    return model(input_ids=input_ids, attention_mask=attention_mask)


def main(argv=None):
    args = parse_args(argv)
    smp.init()  # the configuration SageMaker passes in SM_HP_MP_PARAMETERS
    torch.manual_seed(args.seed)
    dtype = torch.float16 if args.fp16 else torch.bfloat16 if args.bf16 else torch.get_default_dtype()
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1, dtype=dtype):
        model = transformers.AutoModelForCausalLM.from_config(model_config(args))
    model = smp.DistributedModel(model, trace_device="gpu")
    torch.cuda.set_device(smp.local_rank()) if torch.cuda.is_available() else None

    no_decay = ["bias", "layernorm", "ln_"]
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)],
         "weight_decay": args.weight_decay},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ]  # fmt: skip
    optimizer = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.95))
    if args.fp16:
        optimizer = smp.DistributedOptimizer(
            optimizer,
            static_loss_scale=None,
            dynamic_loss_scale=True,
            dynamic_loss_args={"scale_window": 1000, "min_scale": 1, "delayed_shift": 2, "init_scale": 2.0**10},
        )
    else:
        optimizer = smp.DistributedOptimizer(optimizer)
    lr_scheduler = transformers.get_linear_schedule_with_warmup(optimizer, args.warmup_steps, args.max_steps)

    losses, grad_norms = [], []
    for input_ids, attention_mask in batches(args, args.max_steps):
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, optimizer, input_ids, attention_mask, args).reduce_mean()
        if args.grad_clip > 0:
            grad_norms.append(float(optimizer.clip_master_grads(args.grad_clip)))
        optimizer.step()
        if not (args.fp16 and optimizer.overflow):
            lr_scheduler.step()
        losses.append(float(loss))

    model.eval()
    with torch.no_grad():
        input_ids, attention_mask = next(batches(args, 1))
        outputs = eval_step(model, input_ids, attention_mask)
        logits = outputs["logits"].concat()
    return {"losses": losses, "grad_norms": grad_norms, "logits": logits, "model": model, "args": args}


if __name__ == "__main__":
    print(main()["losses"])
