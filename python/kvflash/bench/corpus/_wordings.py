"""Needle wordings per genre and split (four each: three direct, one indirect): the needle as it sits in
the genre, the question asked two ways.

Each wording: `needle` (one unit of the genre, formatted with the `at` fields of the unit it is placed
before and `v`, the value), `question` (the chat question; may name the scene's characters, formatted with
the same fields), `answer` (the assistant turn's primed prefix), `raw` (a raw-completion continuation of
the document in the genre's own form, formatted with the fields of the document's end, that stops where the
value belongs) and `kind` (number: 5 digits; code: two letters, a dash, 4 digits; name: a person's name from
the split's own list).  Tuning and reporting wordings of a genre share no word of five letters or more
outside GENERIC (tests/test_corpus.py checks it).  Original text, CC0.
"""
from __future__ import annotations

# words a question may share across the splits: they name the genre, not the needle
GENERIC = {"according", "agreement", "configuration", "table", "notes", "comment", "comments", "which", "there",
           "under", "after", "their", "these", "about", "given", "where", "whose", "answer", "should", "still",
           "logs", "email"}


def W(needle, question, answer, raw, kind):
    return dict(needle=needle, question=question, answer=answer, raw=raw, kind=kind)


WORDINGS = {
    "code": {
        "tuning": [
            W("{indent}# NOTE: the staging deploy token is {v}; rotate it after each release.\n",
              "What is the staging deploy token noted in the code?", "The staging deploy token is",
              "\nSTAGING_DEPLOY_TOKEN = \"", "code"),
            W("{indent}# fallback port for the metrics sidecar: {v}\n",
              "Which fallback port does the metrics sidecar use, according to the comments?",
              "The fallback port is", "\nSIDECAR_FALLBACK_PORT = ", "number"),
            W("{indent}# owner of this module (ask before refactoring): {v}\n",
              "Who owns this module, according to the comment?", "The owner of the module is",
              "\n__owner__ = \"", "name"),
        ],
        "reporting": [
            W("{indent}# license key for the geocoding vendor, hard-coded for now: {v}\n",
              "What is the geocoding vendor's license key?", "The geocoding license key is",
              "\nGEOCODER_LICENSE_KEY = \"", "code"),
            W("{indent}# magic seed that reproduces the flaky shuffle bug: {v}\n",
              "Which seed reproduces the flaky shuffle bug?", "The seed is", "\nSHUFFLE_BUG_SEED = ", "number"),
            W("{indent}# reviewed and approved by {v}; questions go to them\n",
              "Who reviewed and approved this code?", "It was approved by", "\n__reviewer__ = \"", "name"),
        ],
    },
    "chat": {
        "tuning": [
            W("[{time}] {nick}: fyi the wifi password for the east office is now {v}\n",
              "What is the new wifi password for the east office?", "The wifi password is",
              "[{time}] {nick2}: what's the east office wifi password again?\n[{time}] {nick}: it's ", "code"),
            W("[{time}] {nick}: parking spot for the visitors tomorrow is number {v}\n",
              "Which parking spot number was given for tomorrow's visitors?", "The parking spot is number",
              "[{time}] {nick2}: which parking spot do the visitors get?\n[{time}] {nick}: number ", "number"),
            W("[{time}] {nick}: the on-call person this weekend is {v}, not me\n",
              "Who is on call this weekend?", "The person on call this weekend is",
              "[{time}] {nick2}: who's on call this weekend?\n[{time}] {nick}: ", "name"),
        ],
        "reporting": [
            W("[{time}] {nick}: door code for the loading bay changed to {v} btw\n",
              "What is the loading bay door code now?", "The loading bay door code is",
              "[{time}] {nick2}: anyone remember the loading bay door code?\n[{time}] {nick}: ", "code"),
            W("[{time}] {nick}: conference dial-in pin: {v}, same as the invite\n",
              "What is the PIN for the conference dial-in?", "The dial-in PIN is",
              "[{time}] {nick2}: what's the dial-in pin?\n[{time}] {nick}: ", "number"),
            W("[{time}] {nick}: {v} from procurement said they'd sign off on the laptops\n",
              "Who from procurement said they would sign off on the laptops?", "It was",
              "[{time}] {nick2}: who in procurement is signing off on the laptops?\n[{time}] {nick}: ", "name"),
        ],
    },
    "csv": {
        "tuning": [
            W("{row}\"re-key the east gate padlock to {v}\"\n",
              "What should the east gate padlock be re-keyed to, according to the table notes?",
              "The padlock should be re-keyed to", "\n# summary.csv\nfield,value\neast_gate_padlock,", "number"),
            W("{row}\"courier contact: {v}\"\n", "Who is the courier contact named in the table notes?",
              "The courier contact is", "\n# contacts.csv\nrole,name\ncourier,", "name"),
            W("{row}\"discount voucher {v} applied\"\n",
              "Which discount voucher was applied, according to the notes column?",
              "The discount voucher was", "\n# summary.csv\nfield,value\ndiscount_voucher,", "code"),
        ],
        "reporting": [
            W("{row}\"safe combination for the cash office: {v}\"\n",
              "What is the safe combination for the cash office, as noted in the table?",
              "The safe combination is", "\n# facts.csv\nitem,detail\ncash_office_safe,", "number"),
            W("{row}\"audited by {v}\"\n", "Who audited the row with the audit remark?", "The auditor was",
              "\n# audit.csv\nrole,person\nauditor,", "name"),
            W("{row}\"insurance claim reference {v}\"\n", "What insurance claim reference appears in the notes?",
              "The insurance claim reference is", "\n# facts.csv\nitem,detail\ninsurance_claim,", "code"),
        ],
    },
    "wiki": {
        "tuning": [
            W("The observatory's catalogue designation for the comet it discovered is {v}. ",
              "What catalogue designation did the observatory give the comet it discovered?",
              "The catalogue designation is", "\n\nQuick facts\n\nCatalogue designation of the comet: ", "code"),
            W("The bell in the old tower weighs exactly {v} kilograms, a figure locals repeat with pride. ",
              "How many kilograms does the bell in the old tower weigh?", "The bell weighs",
              "\n\nQuick facts\n\nWeight of the tower bell (kg): ", "number"),
            W("The first recorded keeper of the harbour light was a woman named {v}. ",
              "What was the name of the first recorded keeper of the harbour light?", "The first keeper was",
              "\n\nQuick facts\n\nFirst keeper of the harbour light: ", "name"),
        ],
        "reporting": [
            W("Its herbarium holds a pressed specimen registered under accession {v}. ",
              "Under which accession is the pressed specimen in the herbarium registered?", "The accession is",
              "\n\nInfobox\n\nHerbarium accession of the pressed specimen: ", "code"),
            W("The municipal archive lists {v} volumes in its rare collection. ",
              "How many volumes does the municipal archive list in its rare collection?",
              "The rare collection holds", "\n\nInfobox\n\nVolumes in the rare collection: ", "number"),
            W("The dam was designed by an engineer called {v}, whose portrait hangs in the town hall. ",
              "Which engineer designed the dam?", "The dam was designed by", "\n\nInfobox\n\nDam designer: ", "name"),
        ],
    },
    "manual": {
        "tuning": [
            W("Note: if the display shows error E4, enter service code {v} to unlock it.\n",
              "Which service code unlocks the display after error E4?", "The service code is",
              "\n## Troubleshooting summary\n\n- Service code after error E4: ", "code"),
            W("Tip: the spare filter for this model has part number {v}.\n",
              "What part number does the spare filter have?", "The spare filter's part number is",
              "\n## Spare parts\n\n- Spare filter part number: ", "number"),
            W("Note: this recipe was passed down by {v}, who baked it every winter.\n",
              "Who passed down this recipe?", "The recipe was passed down by",
              "\n## About the recipes\n\nPassed down by: ", "name"),
        ],
        "reporting": [
            W("Caution: the child lock is released with the sequence {v} on the keypad.\n",
              "Which sequence on the keypad releases the child lock?", "The child lock sequence is",
              "\n## Quick reference\n\n- Child lock release sequence: ", "code"),
            W("Important: calibrate the scale to a reference weight of {v} milligrams before first use.\n",
              "What reference weight should the scale be calibrated to?", "The reference weight is",
              "\n## Quick reference\n\n- Calibration reference weight (mg): ", "number"),
            W("Important: the adapted version of this dish comes from {v}, a cook at the harbour canteen.\n",
              "Whose adapted version of this dish is given here?", "The adapted version comes from",
              "\n## Credits\n\nAdapted version from: ", "name"),
        ],
    },
    "fiction": {
        "tuning": [
            W("\"The number on the locker is {v},\" {a} whispered. \"Say it back to me.\"\n\n",
              "What number did {a} give for the locker?", "The locker number is",
              "\"And the locker? What was its number again?\"\n\n\"The number was ", "number"),
            W("\"If anyone asks, the ticket was booked under the name {v},\" said {a}.\n\n",
              "Under which name was the ticket booked?", "The ticket was booked under the name",
              "\"Whose name was on the ticket?\"\n\n\"It was booked under ", "name"),
            W("\"Write it down: the safe-deposit box is {v},\" {a} said, sliding the paper across.\n\n",
              "What did {a} say the safe-deposit box was?", "The safe-deposit box is",
              "\"Which safe-deposit box was it?\"\n\n\"Box ", "code"),
        ],
        "reporting": [
            W("\"The boat's registration is {v}. Remember that, and nothing else,\" {a} told {b}.\n\n",
              "What is the boat's registration that {a} told {b} to remember?", "The boat's registration is",
              "\"The boat, what was its registration?\"\n\n\"", "code"),
            W("{a} pressed a slip into {b}'s hand. On it, in pencil: room {v}.\n\n",
              "Which room was written on the slip {a} gave {b}?", "The room on the slip was",
              "\"What room did the slip say?\"\n\n\"Room ", "number"),
            W("\"Ask for {v} at the border post. Only that one,\" said {a}.\n\n",
              "Whom should one ask for at the border post?", "One should ask for",
              "\"Who are we meant to ask for at the border?\"\n\n\"", "name"),
        ],
    },
    "syslog": {
        "tuning": [
            W("{stamp} {host} vaultd[{pid}]: recovery passphrase for volume data01 rotated to {v}\n",
              "What was the recovery passphrase for volume data01 rotated to?", "The recovery passphrase is",
              "{stamp} {host} audit[{pid}]: current data01 recovery passphrase: ", "code"),
            W("{stamp} {host} licensed[{pid}]: seat count for the render farm raised to {v}\n",
              "To what was the render farm's seat count raised?", "The seat count is",
              "{stamp} {host} audit[{pid}]: render farm seats: ", "number"),
            W("{stamp} {host} pagerd[{pid}]: escalation acknowledged by {v}\n",
              "Who acknowledged the escalation in the logs?", "The escalation was acknowledged by",
              "{stamp} {host} audit[{pid}]: last acknowledgement of an escalation: user=", "name"),
        ],
        "reporting": [
            W("{stamp} {host} kms[{pid}]: envelope key id for tenant blue set to {v}\n",
              "Which envelope key id was set for tenant blue?", "The envelope key id is",
              "{stamp} {host} audit[{pid}]: tenant blue envelope key: ", "code"),
            W("{stamp} {host} replmon[{pid}]: replication lag alarm threshold now {v} ms\n",
              "What is the replication lag alarm threshold in milliseconds?", "The threshold is",
              "{stamp} {host} audit[{pid}]: replication lag alarm (ms): ", "number"),
            W("{stamp} {host} sudo[{pid}]: emergency shell granted to {v} by change board\n",
              "Who was granted the emergency shell?", "The emergency shell was granted to",
              "{stamp} {host} audit[{pid}]: emergency shell holder: ", "name"),
        ],
    },
    "legal": {
        "tuning": [
            W("For the avoidance of doubt, the escrow account referred to in this Agreement is account number "
              "{v}.\n\n", "What is the escrow account number referred to in the Agreement?",
              "The escrow account number is", "SCHEDULE OF PARTICULARS\n\nEscrow account number: ", "number"),
            W("The parties appoint {v} as the sole arbitrator for any dispute under this Agreement.\n\n",
              "Who is appointed as the sole arbitrator?", "The sole arbitrator is",
              "SCHEDULE OF PARTICULARS\n\nSole arbitrator: ", "name"),
            W("The Premises are identified in the land register under title {v}.\n\n",
              "Under which title are the Premises identified in the land register?", "The title is",
              "SCHEDULE OF PARTICULARS\n\nLand register title: ", "code"),
        ],
        "reporting": [
            W("The performance bond issued for this Agreement carries serial {v}.\n\n",
              "What serial does the performance bond carry?", "The performance bond's serial is",
              "ANNEX A: KEY TERMS\n\nPerformance bond serial: ", "code"),
            W("The cap on aggregate liability under this Agreement is fixed at {v} units.\n\n",
              "At how many units is the cap on aggregate liability fixed?", "The liability cap is",
              "ANNEX A: KEY TERMS\n\nLiability cap (units): ", "number"),
            W("Notices to the Company must be marked for the attention of {v}, its company secretary.\n\n",
              "For whose attention must notices to the Company be marked?",
              "Notices must be marked for the attention of", "ANNEX A: KEY TERMS\n\nNotices to the attention of: ",
              "name"),
        ],
    },
    "email": {
        "tuning": [
            W("P.S. the gate code for the new office car park is {v}.\n",
              "What is the gate code for the new office car park?", "The gate code is",
              "\nFrom: {name2}\nSubject: Re: {subject}\n\nHi {first},\n\nQuick one: the car park gate code you sent was ",
              "code"),
            W("Our account number with the caterer is {v}, in case you need to call them.\n",
              "What is the account number with the caterer?", "The account number with the caterer is",
              "\nFrom: {name2}\nSubject: Re: {subject}\n\nHi {first},\n\nQuick one: our caterer account number is ",
              "number"),
            W("The new contact at the bank is {v}; I've forwarded their details.\n",
              "Who is the new contact at the bank?", "The new contact at the bank is",
              "\nFrom: {name2}\nSubject: Re: {subject}\n\nHi {first},\n\nQuick one: the bank's new contact is ",
              "name"),
        ],
        "reporting": [
            W("Booking reference for the train tickets: {v}.\n",
              "What is the booking reference for the train tickets?", "The booking reference is",
              "\nFrom: {name2}\nSubject: Re: {subject}\n\nHi {first},\n\nTo confirm, the train booking reference is ",
              "code"),
            W("The purchase order went through as PO {v}, approved this morning.\n",
              "Which PO did the purchase order go through as?", "The purchase order is PO",
              "\nFrom: {name2}\nSubject: Re: {subject}\n\nHi {first},\n\nTo confirm, the purchase order is PO ",
              "number"),
            W("From next month, invoices should be addressed to {v} in finance.\n",
              "To whom should invoices be addressed from next month?", "Invoices should be addressed to",
              "\nFrom: {name2}\nSubject: Re: {subject}\n\nHi {first},\n\nTo confirm, invoices now go to ", "name"),
        ],
    },
    "config": {
        "tuning": [
            W("{indent}# emergency admin override token: {v}\n",
              "What is the emergency admin override token in the configuration?", "The override token is",
              "\n# summary\noverride_token: \"", "code"),
            W("{indent}cold_storage_quota_mb: {v}\n", "What is the cold storage quota in megabytes?",
              "The cold storage quota is", "\n# summary\ncold_storage_quota_mb: ", "number"),
            W("{indent}# maintainer of this file: {v} (ping before changing timeouts)\n",
              "Who maintains this configuration file?", "The maintainer is", "\n# summary\nmaintainer: \"", "name"),
        ],
        "reporting": [
            W("{indent}signing_secret_hint: \"{v}\"  # rotated quarterly\n",
              "What is the signing secret hint set in the configuration?", "The signing secret hint is",
              "\n# digest\nsigning_secret_hint: \"", "code"),
            W("{indent}# legacy clients still connect on port {v}; do not remove\n",
              "On which port do legacy clients still connect?", "Legacy clients connect on port",
              "\n# digest\nlegacy_port: ", "number"),
            W("{indent}# escalation contact for this service: {v}\n",
              "Who is the escalation contact for this service?", "The escalation contact is",
              "\n# digest\nescalation_contact: \"", "name"),
        ],
    },
}

# name values, one list per split (never words of a document: the builder redraws a name its document holds)
NAMES = {
    "tuning": ["Ottilie Varga", "Bram Castellan", "Noemi Strand", "Cyrus Abernethy", "Liesel Okoro",
               "Tavish Moreau", "Elodie Fairweather", "Jovan Petrakis", "Marguerite Sayer", "Anouk Bellamy",
               "Florian Achebe", "Greer Halloran"],
    "reporting": ["Zosia Pemberton", "Idris Vantongeren", "Philippa Quayle", "Leander Osterberg",
                  "Beatrix Nakamura", "Caspian Delacroix", "Hermione Achterberg", "Thaddeus Ruvolo",
                  "Saoirse Lindqvist", "Evander Castaneda", "Rosalind Okwuosa", "Benedikt Amadi"],
}
HINT = {"number": "Answer with the number only.", "code": "Answer with the code only.",
        "name": "Answer with the name only."}

# A fourth wording per genre and split, indirect: the question paraphrases the needle instead of quoting its
# key words (qk missed the one indirect wording of the prose reporting set), and with four wordings against
# three depths a wording meets every depth over twelve trials.
_INDIRECT = {
    "code": {
        "tuning": W("{indent}# shard count picked after the March load test: {v}\n",
                    "How many partitions did the spring stress trial settle on?", "The number of partitions is",
                    "\nPARTITIONS_AFTER_STRESS_TRIAL = ", "number"),
        "reporting": W("{indent}# build server credentials are kept by {v}, ask them\n",
                       "Which colleague holds the login details for the CI machine?", "The colleague is",
                       "\n__ci_credentials_holder__ = \"", "name"),
    },
    "chat": {
        "tuning": W("[{time}] {nick}: the spare key for the bike shed is with {v} now\n",
                    "Who is holding the extra key to the bicycle storage?", "The extra key is with",
                    "[{time}] {nick2}: who has the bike shed key?\n[{time}] {nick}: ", "name"),
        "reporting": W("[{time}] {nick}: new budget code for the offsite: {v}\n",
                       "Which cost centre should the team retreat be charged to?", "The cost centre is",
                       "[{time}] {nick2}: what do we charge the offsite to?\n[{time}] {nick}: ", "code"),
    },
    "csv": {
        "tuning": W("{row}\"reorder threshold agreed with the buyer: {v}\"\n",
                    "At what stock level did the purchasing contact agree to restock?", "The agreed level is",
                    "\n# summary.csv\nfield,value\nreorder_threshold,", "number"),
        "reporting": W("{row}\"signed off by the night supervisor, {v}\"\n",
                       "Which late-shift manager gave sign-off in the notes?", "The late-shift manager was",
                       "\n# audit.csv\nrole,person\nnight_supervisor,", "name"),
    },
    "wiki": {
        "tuning": W("Local tradition says the founders paid the ferryman {v} silver pieces for the first crossing. ",
                    "How much did the town's first settlers give the boatman to get across?", "They paid",
                    "\n\nQuick facts\n\nFare of the first crossing (silver pieces): ", "number"),
        "reporting": W("A stone near the south gate is carved with the mason's mark {v}. ",
                       "What symbol did the stoneworker leave on the block by the southern entrance?",
                       "The symbol is", "\n\nInfobox\n\nMason's mark at the south gate: ", "code"),
    },
    "manual": {
        "tuning": W("Note: the warranty is void unless the seal number {v} is intact.\n",
                    "Which seal must stay unbroken for the guarantee to apply?", "The seal number is",
                    "\n## Warranty\n\n- Seal number: ", "number"),
        "reporting": W("Important: the firmware was last flashed by technician {v}.\n",
                       "Who updated the device software most recently?", "The software was last updated by",
                       "\n## Service history\n\n- Last firmware update by: ", "name"),
    },
    "fiction": {
        "tuning": W("\"The car's plates read {v}. Follow it,\" {a} said.\n\n",
                    "What was on the number plates of the car {a} wanted followed?", "The plates read",
                    "\"The car we followed, what were its plates?\"\n\n\"", "code"),
        "reporting": W("{a} folded the receipt: {v} crowns, paid in full, and not a coin more.\n\n",
                       "How much did the bill that {a} put away come to?", "The bill came to",
                       "\"How much was on that receipt?\"\n\n\"", "number"),
    },
    "syslog": {
        "tuning": W("{stamp} {host} backupd[{pid}]: nightly snapshot tagged {v}\n",
                    "What label did the overnight backup get?", "The label is",
                    "{stamp} {host} audit[{pid}]: latest nightly snapshot tag: ", "code"),
        "reporting": W("{stamp} {host} quota[{pid}]: mailbox limit for the finance group now {v} MB\n",
                       "How large may the accounting team's inboxes grow?", "The limit is",
                       "{stamp} {host} audit[{pid}]: finance mailbox limit (MB): ", "number"),
    },
    "legal": {
        "tuning": W("The Guarantor under this Agreement is {v}, acting in a personal capacity.\n\n",
                    "Who stands surety for the obligations in the Agreement?", "The guarantor is",
                    "SCHEDULE OF PARTICULARS\n\nGuarantor: ", "name"),
        "reporting": W("The Licensee's filing reference at the registry is {v}.\n\n",
                       "Under what code is the licence holder recorded with the official records office?",
                       "The filing reference is", "ANNEX A: KEY TERMS\n\nLicensee filing reference: ", "code"),
    },
    "email": {
        "tuning": W("The caterer confirmed the headcount at {v} guests.\n",
                    "How many people will the food supplier prepare for?", "The headcount is",
                    "\nFrom: {name2}\nSubject: Re: {subject}\n\nHi {first},\n\nQuick one: the confirmed headcount is ",
                    "number"),
        "reporting": W("Room keys for the offsite can be collected from {v} at reception.\n",
                       "From whom should the team pick up the accommodation keys?", "The keys are with",
                       "\nFrom: {name2}\nSubject: Re: {subject}\n\nHi {first},\n\nTo confirm, the room keys are with ",
                       "name"),
    },
    "config": {
        "tuning": W("{indent}# rate limit agreed with the payments provider: {v} requests per minute\n",
                    "How many calls a minute does the billing partner allow?", "The allowed rate is",
                    "\n# summary\npayments_rate_limit: ", "number"),
        "reporting": W("{indent}feature_flag_cohort: \"{v}\"  # the beta group\n",
                       "Which cohort label are the early-access users given?", "The cohort label is",
                       "\n# digest\nfeature_flag_cohort: \"", "code"),
    },
}
for _g, _by in _INDIRECT.items():
    for _sp, _w in _by.items():
        WORDINGS[_g][_sp].append(_w)
