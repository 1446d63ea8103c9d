// The Vercel AI SDK as an application uses it: the default `openai` and `anthropic` providers,
// pointed at the gateway only by OPENAI_BASE_URL / OPENAI_API_KEY and ANTHROPIC_BASE_URL /
// ANTHROPIC_API_KEY, with no other setting; Google's provider, which reads its key from
// GOOGLE_GENERATIVE_AI_API_KEY but its base URL from no variable, made by createGoogle with the
// base URL this script is given in GOOGLE_GENERATIVE_AI_BASE_URL (as an application passes its
// own setting). Runs the named cases of one provider in one process
// (one Node start-up, not one a case) and prints one line a case:
//   CASE <name> ok <json>          what the call returned (text length, steps, usage)
//   CASE <name> error <json>       the error as the SDK raised it: name, message, status, body
//
//   node ai_sdk.mjs <openai-responses|openai-chat|anthropic|google> <model> <case> [<case>...]
// Cases: generateText, streamText, generateObject, tools (multi-step, stopWhen stepCountIs(3)).
import { generateObject, generateText, stepCountIs, streamText, tool } from "ai";
import { anthropic } from "@ai-sdk/anthropic";
import { createGoogle } from "@ai-sdk/google";
import { openai } from "@ai-sdk/openai";
import { z } from "zod";

// The SDK's deprecation notices (generateObject) are for the application's author, not this run.
globalThis.AI_SDK_LOG_WARNINGS = false;

const [flavour, modelName, ...cases] = process.argv.slice(2);
const MODELS = {
  "openai-responses": () => openai(modelName),
  "openai-chat": () => openai.chat(modelName),
  anthropic: () => anthropic(modelName),
  google: () => createGoogle({ baseURL: process.env.GOOGLE_GENERATIVE_AI_BASE_URL })(modelName),
};
if (!MODELS[flavour] || !modelName || cases.length === 0) {
  console.error("usage: node ai_sdk.mjs <openai-responses|openai-chat|anthropic|google> <model> <case>...");
  process.exit(2);
}
const model = MODELS[flavour]();

const weather = tool({
  description: "The weather in a city now.",
  inputSchema: z.object({ city: z.string() }),
  execute: async ({ city }) => ({ city, celsius: 21, sky: "clear" }),
});

const RUNS = {
  async generateText() {
    const result = await generateText({ model, prompt: "Say hello in five words." });
    return { text_chars: result.text.length, usage: result.usage };
  },
  async streamText() {
    const result = streamText({ model, prompt: "Count from one to five." });
    let chars = 0;
    for await (const delta of result.textStream) chars += delta.length;
    // A stream reports its failure as an error part, not by throwing: surface it as a throw.
    const finish = await result.finishReason;
    if (finish === "error") throw (await result.steps).at(-1)?.error ?? new Error("stream failed");
    return { text_chars: chars, usage: await result.usage };
  },
  async generateObject() {
    const result = await generateObject({
      model,
      schema: z.object({ name: z.string(), ingredients: z.array(z.string()) }),
      prompt: "A recipe for lemonade.",
    });
    return { keys: Object.keys(result.object ?? {}), usage: result.usage };
  },
  async tools() {
    // The first step must call the tool (the stub answers text unless told to call one); later
    // steps are the model's choice, so the loop ends when it answers in text.
    const result = await generateText({
      model,
      tools: { weather },
      stopWhen: stepCountIs(3),
      prepareStep: ({ stepNumber }) => (stepNumber === 0 ? { toolChoice: "required" } : {}),
      prompt: "What is the weather in Paris? Use the tool.",
    });
    return { steps: result.steps.length, usage: result.totalUsage };
  },
};

let failed = 0;
for (const name of cases) {
  const run = RUNS[name];
  if (!run) {
    console.error(`unknown case ${name}`);
    process.exit(2);
  }
  try {
    console.log(`CASE ${name} ok ${JSON.stringify(await run())}`);
  } catch (err) {
    failed += 1;
    const cause = err?.lastError ?? err?.cause ?? err;
    console.log(`CASE ${name} error ${JSON.stringify({
      name: err?.name, message: String(err?.message ?? err),
      status: cause?.statusCode ?? null, body: cause?.responseBody ?? null,
    })}`);
  }
}
process.exit(failed ? 1 : 0);
