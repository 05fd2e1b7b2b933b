"""Pure text pieces shared by tokenizer_svc and the offline engine API.

tokenizer (load_tokenizer, TextTokenizer), chat_template (render_chat, sandboxed),
detokenizer (IncrementalDetokenizer), stop_strings (StopStringMatcher).
"""
