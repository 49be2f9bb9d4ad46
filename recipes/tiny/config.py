"""The dsv41-tiny configuration: a small model of the V4.1 architecture in which every part is active.

Layer plan (10 backbone layers, training context 512, sliding window 64):

    0, 1     SWA only (compress ratio 0)                       Engram before layer 1
    2        encoder, CSA2 m=2, Full    (kv source, index source: 256 compressed entries at T=512)
    3, 4     encoder, CSA2 m=2, Reuse   (read layer 2's KV and its Top-K)
    5        decoder, CSA2 m=1, Full    (kv source, builds the candidate pool: 8 blocks of 8 entries)
    6        decoder, m=1, Reuse                                Engram before layer 6
    7        decoder, m=1, Reindex      (indexer restricted to the pool, re-selects Top-32 of 64)
    8        decoder, m=1, Reuse        (of layer 7's Top-K)
    9        decoder, m=1, Reindex      (pool-restricted again)
    mtp.0-2  three DSpark stages (window-only, 8 routed experts top-2), taps at layers 7, 8, 9

Top-K is 32 compressed entries against 256 (m=2) or 512 (m=1) at the training context, so the
compressed attention really is sparse. MoE: 8 routed experts (top-2, sqrt-softplus router with the
selection-only bias) plus the shared expert in every layer. Storage formats are the official ones:
FP8 E4M3 with 32x32 UE8M0 block scales for dense linears, packed FP4 E2M1 for routed experts, FP8
rows for the Engram tables; training runs them as quantization-aware (straight-through) masters.

Size: the token embedding and the output head (bf16 [129280, 64] each) are 33.1 MB, DSpark's Markov
head (bf16 [129280, 4] twice) 2.1 MB, the two Engram tables (N-grams up to 3, 4 hash heads, about
33K rows of 32 FP8 values each) 1.1 MB each, everything else about 3 MB: 40.4 MB of weights, 47.0 MB
with the tokenizer files, under the 48 MB budget.
"""

from __future__ import annotations

from dsv41.model.config import ModelArgs

TRAIN_CONTEXT = 512


# The vision tower: 4 ViT blocks of width 64 (0.49 MB with the aligner in bf16), small images (at most
# 64 image tokens; the synthetic pictures of recipes/tiny/vision/data.py give 4 to 16).
VISION = dict(
    vision_n_layers=4, vision_dim=64, vision_n_heads=4, vision_inter_dim=128, vision_patch_size=14,
    vision_rope_theta=10000.0, vision_downsample_ratio=3, vision_min_pixels=56 * 56, vision_max_n_token=64,
    vision_max_wh_ratio=None, image_token_id=129264,
)


def tiny_config(trainable: bool = False, vision: bool = False) -> ModelArgs:
    from dsv41.model.engram import engram_table_rows

    args = ModelArgs(
        name="dsv41-tiny", family="v4.1", dtype="fp8", expert_dtype="fp4", fp8_block_size=32,
        vocab_size=129280, dim=64, n_layers=10, n_mtp_layers=3, n_heads=4, head_dim=64, rope_head_dim=16,
        q_lora_rank=64, o_groups=2, o_lora_rank=32, window_size=64,
        moe_inter_dim=128, n_routed_experts=8, n_shared_experts=1, n_activated_experts=2,
        compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1, 1, 1, 0, 0, 0),
        kv_source_layers=(2, 5), index_source_layers=(2, 5, 7, 9),
        index_n_heads=4, index_head_dim=32, index_topk=32,
        candidate_source_layer=5, candidate_topk_blocks=8, candidate_block_size=8,
        original_seq_len=TRAIN_CONTEXT, rope_factor=1.0, max_seq_len=4096, max_position_embeddings=4096,
        engram_layer_ids=(1, 6), engram_num_embeddings=(0, 0), engram_max_ngram_size=3, engram_n_heads=4,
        engram_head_dim=32, engram_vocab_size=4_100,
        dspark_target_layer_ids=(7, 8, 9), dspark_markov_rank=4, dspark_n_routed_experts=8,
        dspark_n_activated_experts=2, vision_n_layers=0, trainable=trainable,
    )
    args = args.replace(engram_num_embeddings=engram_table_rows(args))
    return args.replace(**VISION) if vision else args
