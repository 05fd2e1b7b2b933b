"""Pure text pieces shared by tokenizer_svc, the gateway's local text path and the offline engine API.

tokenizer (load_tokenizer, TextTokenizer), chat_template (render_chat, sandboxed),
detokenizer (IncrementalDetokenizer), stop_strings (StopStringMatcher), streams (DetokCore: a
detokenizer stream's pure core), requests (TokenizeRequest -> ids, DetokenizeRequest -> text).
"""
