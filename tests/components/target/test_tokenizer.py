from components.target.tokenizer import MASK, SPECIAL_TOKENS, stop_token_ids, train_tokenizer

TEXTS = ["def f(x):\n    return x + 1\n", "To be, or not to be: that is the question.\n"] * 50


def test_special_tokens_are_single_ids_and_roundtrip_is_exact():
    tok = train_tokenizer(TEXTS, 400)
    for s in SPECIAL_TOKENS:
        assert len(tok(s, add_special_tokens=False)["input_ids"]) == 1, s
    assert tok.mask_token == MASK and tok.mask_token_id is not None
    text = "Unseen words: naïve café — ∑ ünïcode\n\tindent"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    assert len(stop_token_ids(tok)) == 2


def test_chat_template_renders_roles_and_generation_prompt():
    tok = train_tokenizer(TEXTS, 400)
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|user|>\nHi<|end|>\n<|assistant|>\nHello<|end|>\n<|assistant|>\n"
