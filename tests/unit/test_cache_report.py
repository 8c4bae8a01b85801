from router.metrics import cached_tokens


def test_native_answer_with_tiers():
    answer = (b'{"text":"x","meta_info":{"id":"a","prompt_tokens":600,"cached_tokens":576,'
              b'"cached_tokens_details":{"device":0,"host":0,"storage":576,"storage_backend":"HiCacheFile"}}}')
    assert cached_tokens(answer) == {"total": 576, "device": 0, "host": 0, "storage": 576}


def test_a_batch_sums_its_items_and_an_answer_without_a_report_counts_nothing():
    batch = (b'[{"meta_info":{"cached_tokens":3,"cached_tokens_details":{"device":3,"host":0}}},'
             b'{"meta_info":{"cached_tokens":0}}]')
    assert cached_tokens(batch) == {"total": 3, "device": 3, "host": 0}
    assert cached_tokens(b'{"text":"no report"}') == {}


def test_openai_usage():
    usage = b'{"usage":{"prompt_tokens":9,"prompt_tokens_details":{"cached_tokens":8}}}'
    assert cached_tokens(usage) == {"total": 8}
