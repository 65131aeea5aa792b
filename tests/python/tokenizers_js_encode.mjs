// Encodes texts with Hugging Face's tokenizers.js, an implementation independent of kvx's, for the
// cross-check in test_tokenizer_hf.py: node tokenizers_js_encode.mjs LIB tokenizer.json texts.json [special]
// (special: with the post_processor's special tokens, add_special_tokens: true)
import { readFileSync } from "node:fs";
import { pathToFileURL } from "node:url";

const [lib, tokenizerPath, textsPath, special] = process.argv.slice(2);
const { Tokenizer } = await import(pathToFileURL(lib).href);
const tokenizer = new Tokenizer(JSON.parse(readFileSync(tokenizerPath, "utf8")), {});
const texts = JSON.parse(readFileSync(textsPath, "utf8"));
process.stdout.write(JSON.stringify(texts.map((t) => tokenizer.encode(t, { add_special_tokens: special === "special" }).ids)));
