"""The server's route families, one APIRouter each: completions, chat, responses, tokenizer, admin."""
